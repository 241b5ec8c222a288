"""The sparse mode on the command line and in reports: per-table placements, what bounds
the step, what-ifs over clusters, servers and prices; bad input named."""

from __future__ import annotations

import contextlib
import io
import json
import textwrap

import pytest

from autoplan import cli
from autoplan.sparse import SparsePlan, plan_frame, plan_text

MODEL = textwrap.dedent('''
    import torch
    from torch import nn

    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.user = nn.EmbeddingBag(200_000, 32, mode="sum")
            self.item = nn.EmbeddingBag(5_000, 32, mode="mean")
            self.head = nn.Linear(64, 1)

        def forward(self, u, i):
            return self.head(torch.cat([self.user(u), self.item(i)], 1)).squeeze(-1)

    def factory():
        return Small()

    def example_inputs():
        return torch.zeros(8, 4, dtype=torch.long), torch.zeros(8, 2, dtype=torch.long)
''')


def run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(list(args))
        except SystemExit as exc:
            rc = int(exc.code)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "small.py"
    path.write_text(MODEL)
    return f"{path}:factory"


def test_plan_prints_every_table_and_what_bounds_the_step(model_file, tmp_path):
    out_file = tmp_path / "plan.json"
    rc, out, err = run("plan", model_file, "--sparse", "--cluster", "a100-sxm4-80gb",
                       "--global-batch", "1024", "--servers", "cpu-server-2s-epyc:1",
                       "--out", str(out_file))
    assert rc == 0, err
    assert "on 8 devices + 1 servers" in out and "bound by" in out
    assert "TorchRec-style greedy on the same cost model" in out
    lines = [l for l in out.splitlines() if l.strip().startswith(("user ", "item "))]
    assert len(lines) == 2 and all("hbm" in l or "server" in l or "host" in l for l in lines)
    plan = SparsePlan.from_json(out_file.read_text())
    assert [p.table for p in plan.tables] == ["user", "item"] and plan.num_servers == 1
    rc, js, _ = run("plan", model_file, "--sparse", "--cluster", "a100-sxm4-80gb",
                    "--global-batch", "1024", "--json")
    assert rc == 0 and json.loads(js)["plan"]["estimate"]["fits"] is True


def test_whatif_compares_servers_and_prices(model_file):
    rc, out, err = run("whatif", model_file, "--sparse", "--cluster", "a100-sxm4-80gb",
                       "--nodes", "1", "2", "--servers", "cpu-server-2s-epyc:0",
                       "cpu-server-2s-epyc:2", "--global-batch", "2048", "--price", "5.12",
                       "--server-price", "10.89", "--json")
    assert rc == 0, err
    rows = json.loads(out)
    assert [(r["nodes"], r["servers"]) for r in rows] == [(1, 0), (1, 2), (2, 0), (2, 2)]
    assert all(r["usd_per_million_samples"] > 0 and r["bound_by"] for r in rows)
    assert rows[1]["price_per_hour"] == pytest.approx(8 * 5.12 + 2 * 10.89)


@pytest.mark.parametrize("args, message", [
    (["--servers", "cpu-server-2s-epyc"], "servers are PROFILE:COUNT"),
    (["--servers", "a100-sxm4-80gb:1"], "servers need a server profile"),
])
def test_bad_servers_are_named(model_file, args, message):
    rc, _, err = run("plan", model_file, "--sparse", "--cluster", "a100-sxm4-80gb",
                     "--global-batch", "1024", *args)
    assert rc == 2 and message in err


def test_a_dense_model_with_servers_and_a_file_without_inputs_are_refused(tmp_path):
    rc, _, err = run("plan", "gpt", "--cluster", "a100-sxm4-80gb", "--global-batch", "8",
                     "--servers", "cpu-server-2s-epyc:1")
    assert rc == 2 and "use it with an embedding model" in err
    path = tmp_path / "bare.py"
    path.write_text(MODEL.replace("def example_inputs", "def other_inputs"))
    rc, _, err = run("plan", f"{path}:factory", "--sparse", "--cluster", "a100-sxm4-80gb",
                     "--global-batch", "1024")
    assert rc == 2 and "define example_inputs()" in err


def test_the_frame_has_a_row_per_table(model_file):
    from autoplan.hardware import load_cluster
    from autoplan.sparse import plan_sparse, trace_sparse
    from autoplan.zoo import build_model

    import importlib.util
    path = model_file.rpartition(":")[0]
    spec = importlib.util.spec_from_file_location("m", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, _ = build_model(model_file)
    g = trace_sparse(model, mod.example_inputs())
    plan = plan_sparse(g, load_cluster("a100-sxm4-80gb", devices_per_node=2), global_batch=64)
    df = plan_frame(plan, g)
    assert list(df["table"]) == ["user", "item"] and list(df["rows"]) == [200_000, 5_000]
    assert (df["hbm_GiB"] >= 0).all()
    assert "step = dense" in plan_text(plan, g)
