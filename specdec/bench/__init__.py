"""``specdec bench``: load benchmarks of speculative decoding against plain decoding.

Runs prompt sets (MT-bench, HumanEval, or JSONL files in either format) through one or more
*systems* and writes ``summary.json``, ``report.md``, ``requests.jsonl`` and PNG plots:

- ``spec``: the gateway with adaptive draft length (``num_draft_tokens=0``);
- ``spec-k=N``: the gateway with a fixed draft length N;
- ``spec-ahead`` / ``spec-noahead``: ``spec`` with draft-ahead forced on / off for the request
  (``spec`` takes the gateway's ``--draft-ahead`` default);
- ``spec-k=N-ahead`` / ``spec-k=N-noahead``: fixed N with draft-ahead forced on / off (what the split
  model, ``specdec sim --split``, predicts; the report sets its prediction beside each);
- ``baseline``: the same stack with ``method=none`` (plain decoding);
- ``inprocess``: the core loop without gRPC (``specdec.local.LocalEngine``, adaptive k);
- ``hf``: transformers ``generate`` on the target alone;
- ``hf-assisted``: transformers assisted generation with the same draft model (needs --draft-model);
- ``llamacpp``: llama.cpp's own greedy decoding, in this process, on the target's GGUF file (any stack);
- ``llamacpp-lookup``: the same with llama.cpp's prompt-lookup speculation (its ``lookup`` example, mirrored).

When ``llamacpp`` ran, every system's tokens/s is also given as a ratio to it.

With ``--local`` there is no gateway: ``spec``, ``spec-k=N`` and ``baseline`` run the same loop
in-process (so ``spec`` and ``inprocess`` coincide there).

Metrics follow the usual serving benchmarks: TTFT; TPOT = (latency - TTFT) / (tokens - 1);
ITL counted per token (a chunk of n tokens arriving g after the previous one gives n samples of
g / n, since speculative chunks carry several tokens); end-to-end latency; output tokens/s and
requests/s over the wall time of the run; plus the speculation figures from the final stats.

The analytic bound (``bound``; the formulas are ``specdec.speedup``'s): the best fixed k for the
measured round cost t_round(k) of each k, the baseline's plain round t_plain and time to first
token per decoded token P, and the tokens per round E[tokens](k) (replayed on the target's outputs
for a greedy draft model, else from the acceptance by position),

    bound = max_k (P + t_plain) / (P + t_round(k) / E[tokens](k)),

and ``measured_over_bound`` = (spec tokens/s / baseline tokens/s) / bound.

Modules (each imports only those listed before it):

- ``prompts``: the prompt sets (built-in MT-bench and HumanEval, JSONL files) as ``Conversation``s;
- ``runners``: the systems (``parse_systems``) and the runners that generate one completion each;
- ``metrics``: per-request records, latency distributions, per-system summaries and speedups;
- ``load``: conversations through a runner, back to back or on Poisson arrivals;
- ``bound``: the analytic bound (its formulas are ``specdec.speedup``'s) and the measurements it needs;
- ``model_cache``: the local target and draft, loaded once when a system or a measurement needs them;
- ``llamacpp``: the llama.cpp peer (``llamacpp``, ``llamacpp-lookup``): greedy decoding in llama.cpp in
  this process on the target's GGUF file, N sequences stepped together, and the GGUF / fp32 forward curves;
- ``sweep``: controlled acceptance (``--acceptance-sweep``): the replay drafter's systems, the recording
  pass, the settings file, the bound of each alpha;
- ``report`` and ``plots``: ``report.md`` / ``concurrency.md`` and the PNG plots;
- ``cli``: the command's arguments, a whole run with its outputs, and the concurrency sweep.
"""
