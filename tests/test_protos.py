"""The committed stubs in specdec/v1 must match what protoc generates from protos/."""

from pathlib import Path

from specdec.protogen import ROOT, generate


def test_generated_stubs_are_fresh(tmp_path: Path):
    generate(tmp_path)
    fresh = sorted((tmp_path / "specdec" / "v1").glob("*_pb2*.py*"))
    assert fresh, "protoc generated nothing"
    for path in fresh:
        committed = ROOT / "specdec" / "v1" / path.name
        assert committed.exists(), f"{path.name} is not committed; run `make protos`"
        assert committed.read_text() == path.read_text(), f"{path.name} is stale; run `make protos`"
    committed_names = {p.name for p in (ROOT / "specdec" / "v1").glob("*_pb2*.py*")}
    assert committed_names == {p.name for p in fresh}, "stale stub files without a .proto"
