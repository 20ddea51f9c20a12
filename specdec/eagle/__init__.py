"""Feature-level drafting (EAGLE): a one-layer head over the target's own last hidden states.

- ``head``: ``EagleHead``: fusion, one decoder layer, reduced LM head; the training-time-test
  unroll; save/load (fp16, without the target's embedding)
- ``drafting``: ``HeadSession``, incremental drafting with the head's KV cache
- ``features``: the target's features and greedy labels by teacher forcing, sharded, resumable
- ``train``: the loss (features + tokens, EAGLE-3's training-time test), the resumable training loop
- ``evaluate``: offline greedy acceptance per draft position, and the head's step cost

``specdec train-draft eagle-features | eagle-train | eagle-eval`` run them.
"""
