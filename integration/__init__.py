"""PySpark and Kafka integration: the Kafka stream source, task wrappers, sinks, Kafka helpers."""
