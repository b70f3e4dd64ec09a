"""Train a tool-using agent through the OpenAI-compatible server, token-exact.

    python examples/agent.py [--steps 10] [--problems 8] [--group 4] [--out runs/agent]

A calculator agent (`exactrl/envs/tool_use.py`: the model may call a
`calculator` tool before it answers) plays its episodes with the ordinary
`openai` client against a server running in this process, each episode under
its own session URL. The server records every session's turns as token-level
trajectories: the generated tokens with loss mask 1 and their behaviour
logprobs, the tool results and template tokens between turns with mask 0.
The trainer reads them back, takes a GRPO step over them and copies the new
weights into the server's engine, so the next episodes sample from them.

Nothing here is downloaded: a tokenizer and a tiny Qwen3 are built first and
warm-started on ideal transcripts, so the model knows the tool-call format
(not yet when to use it well). Each step prints the reward, the turns per
episode, the tokens masked out of the loss, and the train/rollout logprob
difference, which is 0.0 with exact kernels: the trajectories the server
recorded are exactly what the trainer recomputes.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path


def build_agent_model(out: Path, seed: int, sft_steps: int):
    """(model, tokenizer): a tokenizer trained on calculator transcripts, a tiny Qwen3 warm-started on them."""
    import torch

    from exactrl.envs.tool_use import CALCULATOR_TOOL, CalculatorTask, ideal_transcript, sft_example
    from exactrl.model import ModelConfig, build_model, save_model
    from exactrl.model.logprobs import token_logprobs
    from exactrl.model.tokenizer import build_tokenizer, default_tokenizer_corpus, load_tokenizer, render_chat_template
    from exactrl.train.warmstart import TINY_QWEN3

    task, rng = CalculatorTask(), random.Random(seed)
    corpus = default_tokenizer_corpus([task], 500, seed)
    corpus += [render_chat_template(ideal_transcript(task.generate(rng)), [CALCULATOR_TOOL], False) for _ in range(500)]
    build_tokenizer(out, corpus, vocab_size=512)
    tok = load_tokenizer(out)
    hf = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": tok.vocab_size,
        "hidden_act": "silu",
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "eos_token_id": tok.end_of_turn_id,
        "pad_token_id": tok.pad_token_id,
        **TINY_QWEN3,
        "max_position_embeddings": 1024,
    }  # room for three turns and their tool results
    model = build_model(ModelConfig.from_hf(hf), kernels="exact", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(sft_steps):  # supervised: the assistant tokens of ideal transcripts (tool call, answer)
        examples = [sft_example(tok, ideal_transcript(task.generate(rng))) for _ in range(16)]
        lps, _ = token_logprobs(model, [ids for ids, _ in examples])
        masks = [torch.tensor(m[1:], dtype=torch.float32) for _, m in examples]
        loss = -sum((lp * m).sum() for lp, m in zip(lps, masks)) / sum(m.sum() for m in masks)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == sft_steps - 1:
            print(f"  warm start {step:4d}  nll {loss.item():.3f}", flush=True)
    save_model(model, out)
    return model, tok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="GRPO steps (default 10)")
    p.add_argument("--problems", type=int, default=8, help="problems per step (default 8)")
    p.add_argument("--group", type=int, default=4, help="episodes per problem, the GRPO group (default 4)")
    p.add_argument("--sft-steps", type=int, default=500, help="warm-start steps (default 500)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default 3e-4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/agent"), help="model, tokenizer and metrics.jsonl")
    args = p.parse_args(argv)
    for name in ("steps", "problems", "group", "sft_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.lr < float("inf"):
        p.error(f"--lr must be a finite number > 0, got {args.lr}")
    if args.group < 2:
        p.error("--group must be >= 2: GRPO's advantage compares the episodes of one problem")

    import torch

    from exactrl.algo.losses import build_loss
    from exactrl.engine import Engine
    from exactrl.envs.tool_use import CalculatorTask, calculator_episode
    from exactrl.rollout.agents import agent_train_step
    from exactrl.server.app import ServerConfig, ServerState, ServerThread, create_app
    from exactrl.train.trainer import StepSettings

    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print(f"building a tokenizer and a tiny Qwen3 in {args.out}", flush=True)
    model, tok = build_agent_model(args.out, args.seed, args.sft_steps)
    # the server's engine holds its own copy of the weights; agent_train_step copies them in bit for bit
    engine = Engine(
        copy.deepcopy(model).requires_grad_(False), stop_token_ids=sorted(tok.stop_token_ids), kv_budget_tokens=16384
    )
    state = ServerState(engine, tok, ServerConfig("calc-agent"))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    settings = StepSettings(
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        micro_batch_size=16,
        agg_mode="token-mean",
        agg_constant=None,
        grad_clip=1.0,
    )
    rng, task = random.Random(args.seed + 1), CalculatorTask()
    print(
        f"serving on a local port; {args.steps} steps of {args.problems} problems x {args.group} episodes", flush=True
    )
    with ServerThread(create_app(state)) as srv, (args.out / "metrics.jsonl").open("w") as log:
        for step in range(1, args.steps + 1):
            problems = [task.generate(rng) for _ in range(args.problems)]
            m = agent_train_step(
                model,
                opt,
                build_loss("ppo"),
                settings,
                state,
                srv.url,
                calculator_episode,
                problems,
                group_size=args.group,
                seed=args.seed,
                step=step,
                env_kwargs=dict(model="calc-agent", max_tokens=48, temperature=1.0),
            )
            log.write(json.dumps(m) + "\n")
            log.flush()
            print(
                f"step {step:3d}  reward {m['rollout/reward_mean']:.3f}  turns {m['rollout/turns_mean']:.2f}  "
                f"masked {m['rollout/masked_tokens_mean']:.1f}  "
                f"|Δlogp| {m['train/train_rollout_logprob_abs_diff']:.1e} "
                f"(max {m['train/train_rollout_logprob_abs_diff_max']:.1e})  "
                f"failed {m['rollout/failed_episodes']:g}",
                flush=True,
            )
    print(f"done in {time.perf_counter() - t0:.0f} s; metrics in {args.out / 'metrics.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
