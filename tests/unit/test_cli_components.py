"""`autoplan plan` / `autoplan run` for a model with components: the plan command plans device groups and
writes a ComponentPlan that `autoplan run` reads; every mistake before launch is one line and exit 2
(the run itself is tests/dist/test_run_components_cli.py). Chain models keep their path."""

from __future__ import annotations

import json

import pytest
import torch

from autoplan.cli.main import main
from autoplan.execute.component_preflight import rank_bytes
from autoplan.plan.components import component_plan_from_dict, load_component_plan

pytest.importorskip("transformers")

PLAN_ARGS = ["plan", "--model", "tiny-llava", "--cluster", "local-cpu", "--devices-per-node", "4", "--global-batch",
             "8", "--seq-len", "24", "--pp", "1", "--cp", "1", "--sp", "off", "--recompute", "none,full",
             "--group-devices", "2,2", "--handoff-microbatches", "2,4", "--top-k", "2", "--quiet"]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("components") / "plan.json"
    assert main([*PLAN_ARGS, "--json", str(path)]) == 0
    return path


def test_plan_of_a_model_with_components_writes_a_component_plan(plan_file, capsys) -> None:
    data = json.loads(plan_file.read_text())
    best = load_component_plan(plan_file)
    assert [g.components for g in best.groups] == [("model.vision_tower", "model.multi_modal_projector"),
                                                  ("model.language_model",)]
    assert [g.num_devices for g in best.groups] == [2, 2] and best.num_microbatches in (2, 4)  # as the flags fix
    ranked = [component_plan_from_dict(p) for p in data["ranked"]]
    assert [p.rank for p in ranked] == [1, 2] and {p.num_microbatches for p in ranked} == {2, 4}
    assert ranked[0].estimate.step_time_s <= ranked[1].estimate.step_time_s
    assert all(g.plan.config.pp == 1 and not g.plan.config.sp for g in best.groups)


def test_the_component_table_is_printed(tmp_path, capsys) -> None:
    assert main([*PLAN_ARGS, "--top-k", "1"]) == 0
    out = capsys.readouterr().out
    assert "vision_tower+multi_modal_projector: 2 dev" in out and "language_model: 2 dev" in out
    assert "pixel_values [1, 3, 16, 16]" in out  # the input shape each sample assumes


def test_the_rank_memory_check_counts_each_groups_parameters(plan_file) -> None:
    from autoplan.models.multimodal import tiny_llava

    plan = load_component_plan(plan_file)
    with torch.device("meta"):
        model = tiny_llava()
    expected = []
    for group in plan.groups:
        c = group.plan.config
        params = sum(p.numel() for n, p in model.named_parameters()
                     if any(n.startswith(path + ".") for path in group.components)
                     or (n.startswith("lm_head.") and "model.language_model" in group.components))
        sharded = {0: (1, 1, 1), 1: (1, 1, c.dp), 2: (1, c.dp, c.dp), 3: (c.dp, c.dp, c.dp)}[c.zero]
        expected.append(4 * params / c.tp / sharded[0] + 4 * params / c.tp / sharded[1] + 8 * params / c.tp / sharded[2])
    assert [b for b, _ in rank_bytes(model, plan)] == pytest.approx(expected)


@pytest.mark.parametrize(("extra", "message"), [
    (["--model", "tiny-policy"], "the plan was made for tiny-llava; plan this model again"),
    (["--model", "tiny-llava", "--nproc-per-node", "3"], "the component plan needs 4 ranks = 2 "),
    (["--model", "tiny-llava", "--global-batch", "16"], "--global-batch 16 differs from the component plan's 8"),
    (["--model", "tiny-llava", "--cluster", "local-cpu"], "--cluster: a component plan carries its own prediction"),
    (["--model", "tiny-llava", "--nnodes", "2"], "component plans run on the local ranks of one node"),
    (["--model", "tiny-llava", "--tp", "2"], "give either --plan or configuration flags"),
])
def test_run_refuses_mistakes_before_launch(plan_file, capsys, extra, message) -> None:
    assert main(["run", "--plan", str(plan_file), "--steps", "1", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_run_refuses_a_group_the_component_executor_cannot_run(plan_file, tmp_path, capsys) -> None:
    data = json.loads(plan_file.read_text())
    config = data["groups"][1]["plan"]["config"]
    config.update(tp=2, dp=1, sp=True)
    edited = tmp_path / "sp.json"
    edited.write_text(json.dumps(data))
    assert main(["run", "--plan", str(edited), "--model", "tiny-llava", "--steps", "1"]) == 2
    assert "group 1 (model.language_model) uses sp=True: the component executor runs dp x tp groups" in \
        capsys.readouterr().err


def test_chain_flags_on_chain_models_are_unchanged(capsys) -> None:
    assert main(["plan", "--model", "tiny-llama", "--cluster", "local-cpu", "--global-batch", "8", "--seq-len", "16",
                 "--group-devices", "4,4"]) == 2
    assert "tiny-llama is one chain" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny-llava", "--cluster", "local-cpu", "--global-batch", "8", "--seq-len", "24",
                 "--export", "megatron", "x.sh"]) == 2
    assert "--export writes chain plans; tiny-llava is planned in device groups" in capsys.readouterr().err
