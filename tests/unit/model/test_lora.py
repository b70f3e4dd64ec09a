"""LoRA (model/lora.py, lora_files.py): the engine's logprobs equal the trainer's bit for bit with adapters
attached (the fast twin differs), only the adapters train and sync, and the files are PEFT's: peft loads
them onto the transformers model, and a merged export loads in exactrl and transformers, within 1e-4 of the
unmerged model's logits in fp32.

Adapters are given random non-zero B (a fresh adapter's B is zero, which would leave the base model's output).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from engine_helpers import mismatches

import exactrl
from exactrl import Engine, SamplingParams
from exactrl.kernels import native
from exactrl.model import forward_logits
from exactrl.model.lora import (
    TARGETS,
    adapter_weights,
    add_lora,
    engine_copy,
    merge_lora,
    synced_weights,
    trainable_parameters,
)
from exactrl.model.lora_files import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    adapter_metadata,
    load_adapters,
    save_adapters,
)
from exactrl.train.config import load_config

V = 211  # conftest TINY vocabulary


def lora_model(path, dtype="float32", kernels="exact", rank=4, alpha=8.0, targets=TARGETS, seed=0):
    """The model at `path` with adapters whose A and B are both random (seeded)."""
    m = add_lora(exactrl.load_model(path, dtype=dtype, kernels=kernels), rank, alpha, targets, seed, str(path))
    randomize(m, seed)
    return m


def randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for p in adapter_weights(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def prompts(seed: int, lengths=(3, 40, 77, 20)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(V) for _ in range(n)] for n in lengths]


def engine_mismatches(model, ps, sp, **engine_args):
    engine = Engine(engine_copy(model), **engine_args)
    outs = engine.generate(ps, sp)
    return mismatches(model, [(p, c, sp) for p, o in zip(ps, outs) for c in o]), engine


# ---------------------------------------------------------------- settings


def test_settings_default_off_and_refuse_bad_values():
    lo = load_config(None, []).model.lora
    assert lo.rank == 0 and lo.dropout == 0.0 and lo.targets == list(TARGETS)
    assert load_config(None, ["model.lora.rank=8", "model.lora.targets=[q_proj,v_proj]"]).model.lora.rank == 8
    with pytest.raises(ValueError, match=r"\['qproj'\] are not projections.*valid names.*'q_proj'.*'down_proj'"):
        load_config(None, ["model.lora.targets=[qproj]"])
    with pytest.raises(ValueError, match="dropout.*not supported.*logprobs would differ"):
        load_config(None, ["model.lora.dropout=0.05"])
    for bad in (
        "model.lora.rank=-1",
        "model.lora.alpha=0",
        "model.lora.targets=[]",
        "model.lora.targets=[q_proj,q_proj]",
    ):
        with pytest.raises(ValueError, match="model.lora"):
            load_config(None, [bad])


def test_add_lora_refuses_bad_arguments(qwen3_dir):
    m = exactrl.load_model(qwen3_dir)
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        add_lora(m, 0, 8.0)
    with pytest.raises(ValueError, match="alpha must be a number > 0"):
        add_lora(m, 4, float("nan"))
    with pytest.raises(ValueError, match="valid names"):
        add_lora(m, 4, 8.0, ["lm_head"])
    add_lora(m, 4, 8.0)
    with pytest.raises(ValueError, match="already carries LoRA adapters"):
        add_lora(m, 4, 8.0)


# ---------------------------------------------------------------- the model


def test_adapters_are_peft_named_frozen_base_and_start_as_the_base(qwen3_dir):
    base = exactrl.load_model(qwen3_dir)
    m = add_lora(exactrl.load_model(qwen3_dir), 4, 8.0, ["q_proj", "down_proj"])
    names = sorted(adapter_weights(m))
    assert names == sorted(
        f"model.layers.{i}.{mod}.lora_{ab}.weight"
        for i in range(2)
        for mod in ("self_attn.q_proj", "mlp.down_proj")
        for ab in "AB"
    )
    q = m.model.layers[0].self_attn.q_proj
    assert q.lora_A.weight.shape == (4, 64) and q.lora_B.weight.shape == (64, 4) and q.lora_scale == 2.0
    assert not q.lora_B.weight.any() and q.lora_A.weight.abs().max() <= 1 / 64**0.5  # PEFT's init
    assert {id(p) for p in trainable_parameters(m)} == {id(p) for p in adapter_weights(m).values()}
    assert set(synced_weights(m)) == set(names) and set(synced_weights(base)) == set(base.state_dict())
    seqs = prompts(0)
    for a, b in zip(forward_logits(m, seqs), forward_logits(base, seqs)):  # B = 0: the base's bits
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="LoRA adapters: save them with"):
        exactrl.save_model(m, qwen3_dir / "never")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_equals_trainer_bitwise_with_adapters(qwen3_dir, dtype):
    # bf16: two targets (each new weight shape costs the tile checks of kernels/linear.py `short_rows`)
    m = lora_model(qwen3_dir, dtype, targets=TARGETS if dtype == "float32" else ["q_proj", "down_proj"])
    base = exactrl.load_model(qwen3_dir, dtype=dtype)
    ps = prompts(1)
    assert not torch.equal(exactrl.sequence_logprobs(m, ps[1:2])[0], exactrl.sequence_logprobs(base, ps[1:2])[0])
    sp = SamplingParams(max_tokens=12, n=2, seed=1, temperature=0.9, top_k=50)
    bad, engine = engine_mismatches(m, ps, sp, max_num_batched_tokens=64)  # chunked prefill too
    assert not bad
    if dtype == "float32":  # decode steps were recorded graphs, replayed with the adapters' products
        assert engine._graphs.num_replays > 0


def test_fast_twin_differs(qwen3_dir):
    sp = SamplingParams(max_tokens=12, n=2, seed=1)
    assert engine_mismatches(lora_model(qwen3_dir, kernels="fast"), prompts(1), sp)[0]


def test_graph_replays_equal_the_eager_engine(qwen3_dir):
    m = lora_model(qwen3_dir)
    ps = prompts(2, (1, 7, 33, 50, 2))
    sp = SamplingParams(max_tokens=12, n=2, seed=3, ignore_eos=True)
    graphs, eager = Engine(engine_copy(m)), Engine(engine_copy(m), decode_graphs=False)
    got = [[(c.token_ids, c.logprobs) for c in o] for o in graphs.generate(ps, sp)]
    assert got == [[(c.token_ids, c.logprobs) for c in o] for o in eager.generate(ps, sp)]
    assert graphs._graphs.num_replays > 0


def test_native_scale_has_torchs_bits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4099, generator=g) * torch.logspace(-40, 38, 4099)  # subnormals to near the largest float
    for s in (2.0, 0.3, 1 / 3, 16 / 7, 1e-30, 3.4e38, 5):
        assert torch.equal(native.scale(x, s), x * s)


def test_engine_copy_shares_the_frozen_base_and_copies_the_adapters(qwen3_dir):
    m = lora_model(qwen3_dir)
    e = engine_copy(m)
    assert e.model.embed_tokens.weight is m.model.embed_tokens.weight
    assert e.model.layers[0].self_attn.q_proj.weight is m.model.layers[0].self_attn.q_proj.weight
    a, b = e.model.layers[0].self_attn.q_proj.lora_A.weight, m.model.layers[0].self_attn.q_proj.lora_A.weight
    assert a is not b and torch.equal(a, b) and not a.requires_grad and b.requires_grad


# ---------------------------------------------------------------- training and sync


def test_only_adapters_get_gradients_and_the_base_stays(qwen3_dir):
    m = lora_model(qwen3_dir)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = torch.optim.AdamW(trainable_parameters(m), lr=1e-2)
    lps = exactrl.sequence_logprobs(m, prompts(3))
    torch.cat(lps).sum().backward()
    adapters = set(adapter_weights(m))
    assert all((p.grad is not None) == (n in adapters) for n, p in m.named_parameters())
    opt.step()
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]) != (n in adapters), n


def test_adapter_gradients_match_autograd_of_plain_torch(qwen3_dir):
    """The exact kernels' backward against `fast` mode's (F.linear and torch's autograd), within rounding:
    each gradient sums many tokens' terms (some cancel to near zero), so the tolerance scales with its largest
    entry, as test_gradients.py's RMSNorm check does."""
    grads = []
    for kernels in ("exact", "fast"):
        m = lora_model(qwen3_dir, kernels=kernels)
        torch.cat(exactrl.sequence_logprobs(m, prompts(4))).sum().backward()
        grads.append({n: p.grad for n, p in adapter_weights(m).items()})
    for n, g in grads[0].items():
        ref = grads[1][n]
        assert torch.allclose(g, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item()) and g.abs().sum() > 0, n


def test_update_weights_takes_the_adapters_alone(qwen3_dir):
    trainer = lora_model(qwen3_dir)
    engine = Engine(engine_copy(trainer))
    ps, sp = prompts(5), SamplingParams(max_tokens=10, seed=2)
    engine.generate(ps, sp)
    captured = engine._graphs.num_captures
    randomize(trainer, 7)  # a training step's new adapters
    assert engine.update_weights(synced_weights(trainer), version=3) == 3
    outs = engine.generate(ps, sp)
    assert not mismatches(trainer, [(p, c, sp) for p, o in zip(ps, outs) for c in o])
    assert engine._graphs.num_captures == captured  # the graphs survived: the adapters' packs refreshed in place
    assert engine.update_weights(trainer.state_dict()) == 4  # every parameter: still taken
    some = dict(list(synced_weights(trainer).items())[:3])
    with pytest.raises(ValueError, match="some of the model's LoRA adapters but not"):
        engine.update_weights(some)
    plain = Engine(exactrl.load_model(qwen3_dir))
    with pytest.raises(ValueError, match="does not match the model: missing"):
        plain.update_weights(some)


# ---------------------------------------------------------------- files


def test_peft_loads_the_adapters_onto_transformers(qwen3_dir, tmp_path):
    import peft
    import transformers

    m = lora_model(qwen3_dir, targets=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    save_adapters(m, tmp_path)
    cfg = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["r"] == 4
    assert cfg["lora_alpha"] == 8.0 and cfg["base_model_name_or_path"] == str(qwen3_dir)
    assert f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight" in _keys(tmp_path / ADAPTER_WEIGHTS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(hf, tmp_path).eval()
    ids = prompts(6, (50,))
    with torch.no_grad():
        theirs = pm(torch.tensor(ids)).logits[0]
    ours = forward_logits(m, ids)[0]
    assert (ours - theirs).abs().max() < 1e-4
    assert (ours - forward_logits(exactrl.load_model(qwen3_dir), ids)[0]).abs().max() > 1e-2  # the adapters matter
    again = load_adapters(exactrl.load_model(qwen3_dir), tmp_path)  # back into exactrl: the same bits
    assert torch.equal(forward_logits(again, ids)[0], ours)


def _keys(path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def test_merged_model_loads_in_exactrl_and_transformers(qwen3_dir, tmp_path):
    import transformers

    m = lora_model(qwen3_dir)
    exactrl.save_model(merge_lora(m), tmp_path)
    ids = prompts(7, (60,))
    ours = forward_logits(m, ids)[0]
    merged = exactrl.load_model(tmp_path)
    assert merged.lora is None and not adapter_weights(merged)
    assert (forward_logits(merged, ids)[0] - ours).abs().max() < 1e-4
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        assert (hf(torch.tensor(ids)).logits[0] - ours).abs().max() < 1e-4


def test_adapters_refuse_another_base_and_unsupported_files(qwen3_dir, tmp_path):
    from conftest import make_hf_model

    m = lora_model(qwen3_dir)
    save_adapters(m, tmp_path / "a")
    assert adapter_metadata(tmp_path / "a")["exactrl_base_sha256"] == m.lora.base_sha256
    make_hf_model(tmp_path / "other", "qwen3", seed=1)
    with pytest.raises(ValueError, match="trained on a base model whose weights differ"):
        load_adapters(exactrl.load_model(tmp_path / "other"), tmp_path / "a")
    with pytest.raises(ValueError, match="are not the model's"):
        load_adapters(add_lora(exactrl.load_model(qwen3_dir), 8, 8.0), tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / ADAPTER_CONFIG).read_text())
    for key, value, match in (
        ("use_dora", True, "use_dora=True is not supported"),
        ("target_modules", ["lm_head"], "target_modules must be a list of names from"),
        ("r", 0, "r must be an int >= 1"),
    ):
        (tmp_path / "a" / ADAPTER_CONFIG).write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ValueError, match=match):
            load_adapters(exactrl.load_model(qwen3_dir), tmp_path / "a")
