"""ftlayer: a Storm-style acker and replay layer for PySpark Structured Streaming fed by Kafka."""

__version__ = "0.1.0"
