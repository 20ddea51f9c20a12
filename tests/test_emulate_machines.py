"""``specdec up --emulate-machines``: two machines on one. The verifier runs on its own cores, the drafter
and the gateway on the others (CPU affinity set before each service's first instruction, so every thread
it starts inherits it), the verifier's threads match its cores, and output stays token-identical to plain
decoding through the partitioned stack."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from specdec.client import GatewayClient
from specdec.stack import LocalStack
from specdec.up import children, machine_partition

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two machines need two cores")


def test_machine_partition_splits_the_cores():
    assert machine_partition({0, 1}) == (frozenset({0}), frozenset({1}))
    assert machine_partition({4, 5, 6, 7, 8}) == (frozenset({4, 5, 6}), frozenset({7, 8}))
    with pytest.raises(SystemExit):
        machine_partition({3})


def _allowed(pid: int) -> set[int]:
    """The cores a process (or thread: /proc/<pid>/task/<tid>) may run on, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            out: set[int] = set()
            for part in line.split(":", 1)[1].strip().split(","):
                lo, _, hi = part.partition("-")
                out.update(range(int(lo), int(hi or lo) + 1))
            return out
    raise AssertionError("no Cpus_allowed_list")


def test_children_carry_the_partition(tiny_pair):
    _, target, draft = tiny_pair
    from specdec.cli import build_parser

    args = build_parser().parse_args(["up", "--target", str(target), "--draft-model", str(draft), "--emulate-machines"])
    specs = {spec.name: spec for spec in children(args)}
    verifier, others = machine_partition(os.sched_getaffinity(0))
    assert specs["verifier"].cpus == verifier and specs["drafter"].cpus == others and specs["gateway"].cpus == others
    command = specs["verifier"].command
    assert command[command.index("--threads") + 1] == str(len(verifier))
    plain = argparse.Namespace(**{**vars(args), "emulate_machines": False})
    assert all(spec.cpus is None for spec in children(plain))


def test_the_partitioned_stack_is_pinned_and_exact(tiny_pair):
    _, target, draft = tiny_pair
    verifier_cpus, other_cpus = machine_partition(os.sched_getaffinity(0))
    stack = LocalStack(["--target", str(target), "--draft-model", str(draft), "--drafter-nice", "0",
                        "--emulate-machines"], quiet=True)
    with stack as address:
        pids = stack.service_pids()
        assert set(pids) == {"verifier", "drafter", "gateway"}
        for role, cores in (("verifier", verifier_cpus), ("drafter", other_cpus), ("gateway", other_cpus)):
            threads = [int(t) for t in os.listdir(f"/proc/{pids[role]}/task")]
            assert len(threads) > 1  # grpc and torch threads, started after the pinning ...
            for tid in threads:  # ... all on the role's cores
                assert _allowed(tid) == set(cores), (role, tid)
        client = GatewayClient(address)
        try:
            for prompt in ("def add(a, b):", "The quick brown fox"):
                plain = client.generate(prompt=prompt, max_new_tokens=24, ignore_eos=True, method="none")
                spec = client.generate(prompt=prompt, max_new_tokens=24, ignore_eos=True, num_draft_tokens=3)
                assert spec.token_ids == plain.token_ids
                assert spec.stats["draft_tokens"] > 0  # it speculated
        finally:
            client.close()
