"""The ``gguf`` runtime: GGUF files as shipped, on llama.cpp's CPU kernels.

``build`` compiles llama.cpp's library at setup; ``binding`` loads it (the best CPU variant this
host runs) and calls it through ``native/specdec_llama.c``; ``runtime`` runs sessions as llama.cpp
sequences of one context, with the same contract as the lean runtime's KV sessions.
"""


class SequencesExhausted(RuntimeError):
    """Every sequence of the context is held by a live session (here, without torch, for the services'
    session plumbing, which turns it into an overload)."""
