"""Distilling a small draft model from a target: prompts, the target's own answers, training, evaluation.

The recipe behind the shipped draft for the embedded SmolLM2-135M-Instruct target
(``specdec/drafts/smollm2-135m-draft``); ``specdec train-draft`` runs it.
"""
