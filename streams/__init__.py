"""The streaming edge: a local Apache Kafka broker for development and tests, and (with the Kafka pipeline)
the producer SDK, the Faust worker and the sink. No business rules live here: agents call the ledger core."""
