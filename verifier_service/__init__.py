"""The verifier service: holds the target model and one KV-cached session per stream."""
