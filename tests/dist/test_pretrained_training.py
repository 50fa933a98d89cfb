"""Training from imported Hugging Face weights (``checkpoint.pretrained``).

A tiny ``LlavaForConditionalGeneration`` (CLIP tower, feature layer -2, Qwen2
decoder: GQA, QKV bias, tied embeddings, so PP2 ties them across stages) is built with the shapes dataset's vocabulary and image
token, imported with tools/hf_import.py and trained with the job config plus
the ``model.yaml`` the import wrote:
- TP2 and PP2 match TP1 per step within 1e-6 relative (step 1 is the loss of
  the imported weights on the first batch, before any update);
- stage 1 (projector only) lowers the loss while the LM and ViT stay
  bit-identical to the imported weights, and its checkpoint exports to a
  ``transformers`` model whose logits match ours within 1e-4.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests import hf_models
from tests.launcher import kill_group, assert_same_training, read_training, run, start_training, train_and_read

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

STEPS = 4
RTOL = 1e-6
GRAD_RTOL = 1e-5


@pytest.fixture(scope="module")
def imported(tmp_path_factory, llava_dataset):
    from megascale_omni.data.tokenizer import TextTokenizer

    tok = TextTokenizer.from_path(llava_dataset / "tokenizer.json")
    root = tmp_path_factory.mktemp("pretrained")
    hf_models.llava(root / "hf", text="qwen2", vocab=tok.vocab_size, image_token=tok.image_token_id, seed=5)
    # In this process (the command line itself runs in tests/e2e/test_hf_interop.py).
    hf_models.tool_main("hf_import.py", "--llava", root / "hf", "--out", root / "imported", "--seq-length", 256)
    return root / "imported"


def _args(dataset, imported, overrides, steps=STEPS):
    return ["--config", "examples/llava/tiny_cpu.yaml", "--config", str(imported / "model.yaml"),
            f"data.path={dataset}", f"train.steps={steps}", "train.eval_interval=0", *overrides]


def _train(tmp_path_factory, dataset, imported, name, nproc, overrides, steps=STEPS):
    out = tmp_path_factory.mktemp(f"pretrained-{name}")
    return train_and_read("pretrain_llava.py", nproc, _args(dataset, imported, overrides, steps), out, steps,
                          timeout=400), out


STAGE1_STEPS = 30
STAGE1 = ["model.freeze=true", "vision.freeze=true", "train.lr=5e-3", "checkpoint.dir={output_dir}/checkpoints"]
STAGE1_TEST = "test_stage1_from_imported_llava_trains_the_projector_only"


@pytest.fixture(scope="module")
def one_process_runs(request, tmp_path_factory, llava_dataset, imported):
    """The TP1 baseline and, when its test is selected, the stage-1 run
    (records, run directory): both one process, started together so that
    they share the 2 cores of the CI host."""
    runs = {"base": ([], STEPS)}
    if any(item.name == STAGE1_TEST for item in request.session.items):
        runs["stage1"] = (STAGE1, STAGE1_STEPS)
    started = {}
    try:
        for name, (overrides, steps) in runs.items():
            out = tmp_path_factory.mktemp(f"pretrained-{name}")
            started[name] = (start_training("pretrain_llava.py", 1, _args(llava_dataset, imported, overrides, steps),
                                            out, timeout=400), out, steps)
        return {name: (read_training(proc, out, steps, timeout=400), out) for name, (proc, out, steps) in started.items()}
    finally:
        for proc, _, _ in started.values():  # after a failure: no run outlives the fixture
            kill_group(proc)
            proc.wait()


@pytest.fixture(scope="module")
def baseline(one_process_runs):
    records, _ = one_process_runs["base"]
    return records


@pytest.mark.parametrize("name,overrides", [("tp2", ["parallel.tp=2"]), ("pp2", ["parallel.pp=2"])])
def test_pretrained_llava_under_tp2_and_pp2_matches_one_process(tmp_path_factory, llava_dataset, imported,
                                                                 baseline, name, overrides):
    records, _ = _train(tmp_path_factory, llava_dataset, imported, name, 2, overrides)
    assert_same_training(baseline, records, name, RTOL, GRAD_RTOL, counters=("samples", "loss_tokens"))


def test_stage1_from_imported_llava_trains_the_projector_only(one_process_runs, baseline, imported):
    steps = STAGE1_STEPS
    records, out = one_process_runs["stage1"]
    assert records[0]["loss"] == pytest.approx(baseline[0]["loss"], rel=1e-6)  # same weights, same first batch
    first, last = (sum(r["loss"] for r in part) / 5 for part in (records[:5], records[-5:]))
    print(f"\nstage 1: mean loss of steps 1-5 {first:.4f}, of steps {steps - 4}-{steps} {last:.4f}")
    assert last < first - 0.05, f"stage 1 did not learn: mean loss {first:.3f} -> {last:.3f}"

    from megascale_omni.checkpoint.pretrained import load_model_weights, open_model_checkpoint
    from megascale_omni.models.standalone import build_model, one_process

    states = []
    for path in (imported, out / "checkpoints"):
        ckpt = open_model_checkpoint(path, "test")
        m = ckpt.cfg.model
        with one_process():
            model = build_model(ckpt.cfg, m.padded_vocab_size(m.vocab_size))
            load_model_weights([model], ckpt, "test")
            states.append({k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")})
    before, after = states
    assert set(before) == set(after)
    frozen = [k for k in before if not k.startswith("vision_projection.")]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("vision_projection."))

    # The trained model exports (the import record travels in its checkpoints) and HF agrees with us.
    import transformers

    hf_models.tool_main("hf_export.py", "--checkpoint", out / "checkpoints", "--out", out / "hf")
    reloaded = transformers.LlavaForConditionalGeneration.from_pretrained(str(out / "hf")).eval()
    image_token = reloaded.config.image_token_index
    tokens = torch.randint(5, reloaded.config.text_config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(3))
    tokens[0, 4:20] = image_token
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = reloaded(input_ids=tokens, pixel_values=pixels).logits
    ours = hf_models.our_logits(out / "checkpoints", tokens, pixels, image_token)
    assert (ours - ref).abs().max().item() <= 1e-4


# slow (make test-all): ~40 s; the architecture check is the resume one
@pytest.mark.slow
def test_pretrained_weights_with_another_architecture_exit_2(tmp_path, llava_dataset, imported):
    # The job config alone (without the import's model.yaml) describes another model.
    r = run([sys.executable, "pretrain_llava.py", "--config", "examples/llava/tiny_cpu.yaml",
             f"data.path={llava_dataset}", f"checkpoint.pretrained={imported}", f"logging.output_dir={tmp_path}"],
            timeout=240)
    assert r.returncode == 2, r.output
    assert "checkpoint.pretrained" in r.stderr and "the model differs" in r.stderr and "Traceback" not in r.stderr
