"""The gateway: the public Generate API, running the speculative loop over drafter and verifier streams."""
