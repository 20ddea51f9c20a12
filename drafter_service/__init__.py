"""The drafter service: a draft method (a small model or n-gram lookup) and one session per stream."""
