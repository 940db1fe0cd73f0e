"""``agentspec shards``: list, stats, export, import, compact."""

from __future__ import annotations

import json
import stat

import pytest

from agentspec import SuffixTree
from agentspec.__main__ import main
from agentspec._store.store import ShardStore

A = ("acme", "sql", "plan")
D = ("default", None, None)
X = ("default", None, "x")


def content(tree):
    return {sid: tree.sequence(sid) for sid in tree.sequence_ids()}


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "store"
    with ShardStore(path, fsync=False) as st:
        st.learn(A, [1, 2, 3])
        st.learn(A, [4, 5])
        st.learn(D, [9])
    return path


def run(capsys, *argv):
    rc = main(["shards", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_list(store, capsys):
    rc, out, _ = run(capsys, "list", "--store", str(store))
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["TENANT", "PIPELINE", "STAGE"]
    assert sorted(line.split() for line in lines[1:]) == [
        ["acme", "sql", "plan"],
        ["default", "-", "-"],
    ]
    rc, out, _ = run(capsys, "list", "--store", str(store), "--json", "--tenant", "acme")
    assert rc == 0
    assert json.loads(out) == [{"tenant": "acme", "pipeline": "sql", "stage": "plan"}]


def test_stats(store, capsys):
    rc, out, _ = run(capsys, "stats", "--store", str(store), "--json")
    assert rc == 0
    docs = {(d["tenant"], d["pipeline"], d["stage"]): d for d in json.loads(out)}
    with ShardStore(store) as st:
        for key in (A, D):
            s = st.stats(key)
            d = docs[key]
            assert (d["sequences"], d["tokens"], d["bytes"], d["evicted"]) == (
                s.sequences,
                s.tokens,
                s.bytes,
                s.evicted,
            )
            assert (d["first_seq"], d["last_seq"]) == (s.first_seq, s.last_seq)
            assert d["version"] > 0
    assert (docs[A]["sequences"], docs[A]["tokens"]) == (2, 5)
    rc, out, _ = run(capsys, "stats", "--store", str(store))
    assert rc == 0
    header, *rows = out.splitlines()
    assert header.split() == [
        "TENANT",
        "PIPELINE",
        "STAGE",
        "SEQUENCES",
        "TOKENS",
        "BYTES",
        "VERSION",
        "EVICTED",
    ]
    row = next(r.split() for r in rows if r.startswith("acme"))
    assert row[3:5] == ["2", "5"]


def test_export_import_round_trip(store, tmp_path, capsys):
    out_file = tmp_path / "a.ashd"
    key_args = ["--tenant", "acme", "--pipeline", "sql", "--stage", "plan"]
    rc, out, _ = run(capsys, "export", "--store", str(store), *key_args, str(out_file), "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["bytes"] == out_file.stat().st_size
    assert stat.S_IMODE(out_file.stat().st_mode) == 0o600
    assert content(SuffixTree.from_bytes(out_file.read_bytes())) == {1: [1, 2, 3], 2: [4, 5]}

    other = tmp_path / "other"
    rc, out, _ = run(capsys, "import", "--store", str(other), "--stage", "x", str(out_file))
    assert rc == 0
    assert "2 sequences" in out
    with ShardStore(other) as st:
        assert st.keys() == [X]
        assert content(st.tree(X)) == {1: [1, 2, 3], 2: [4, 5]}
        st.learn(X, [7])

    small = SuffixTree()
    small.add(40, [6, 6])
    small_file = tmp_path / "small.ashd"
    small_file.write_bytes(small.to_bytes())
    rc, _, _ = run(capsys, "import", "--store", str(other), "--stage", "x", str(small_file))
    assert rc == 0
    with ShardStore(other) as st:
        assert sorted(content(st.tree(X))) == [1, 2, 3, 40]
    argv = ["import", "--store", str(other), "--stage", "x", "--replace", "--json"]
    rc, out, _ = run(capsys, *argv, str(small_file))
    assert rc == 0
    assert json.loads(out)["sequences"] == 1
    with ShardStore(other) as st:
        assert content(st.tree(X)) == {40: [6, 6]}


def test_export_to_stdout(store, capsysbinary):
    rc = main(["shards", "export", "--store", str(store), "-"])
    out, _ = capsysbinary.readouterr()
    assert rc == 0
    assert content(SuffixTree.from_bytes(out)) == {1: [9]}


def test_compact_empties_journals(store, capsys):
    journals = list(store.glob("shards/*/journal.log"))
    assert len(journals) == 2
    assert any(j.stat().st_size > 0 for j in journals)
    rc, out, _ = run(capsys, "compact", "--store", str(store), "--json")
    assert rc == 0
    assert json.loads(out) == {"shards": 2}
    assert all(j.stat().st_size == 0 for j in journals)
    with ShardStore(store) as st:
        assert content(st.tree(A)) == {1: [1, 2, 3], 2: [4, 5]}


def test_errors(store, tmp_path, capsys):
    rc, _, err = run(capsys, "list", "--store", str(tmp_path / "missing"))
    assert rc == 1
    assert "no shard store" in err
    assert not (tmp_path / "missing").exists()

    target = str(tmp_path / "x.ashd")
    rc, _, err = run(capsys, "export", "--store", str(store), "--tenant", "nobody", target)
    assert rc == 1
    assert "no shard with this key" in err

    bad = tmp_path / "bad.ashd"
    bad.write_bytes(b"ASHD" + b"\x00" * 60)
    rc, _, err = run(capsys, "import", "--store", str(store), str(bad))
    assert rc == 1
    assert "agentspec: error:" in err
    with ShardStore(store) as st:
        assert content(st.tree(D)) == {1: [9]}
        rc, _, err = run(capsys, "compact", "--store", str(store))
        assert rc == 1
        assert "in use by another ShardStore" in err

    rc, _, err = run(capsys, "export", "--store", str(store), "--stage", "", target)
    assert rc == 1
    assert "stage" in err
    assert not (tmp_path / "x.ashd").exists()

    assert main(["shards"]) == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["shards", "list"])  # --store is required
    assert info.value.code == 2
