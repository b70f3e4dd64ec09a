"""`exactrl parity`: checks the exactness contract on a model (or a server against this trainer) and prints
the verdict; `debug/parity.py` computes it."""

from __future__ import annotations

import json


def parity_main(args, fail) -> int:
    """`exactrl parity`: the model's own kernels, or (--server) a server's logprobs against this trainer's."""
    import exactrl
    from exactrl.debug.parity import run_parity

    if not args.server:  # they would be ignored: a check of the server the user meant would never run
        given = [
            flag
            for flag, value, default in [
                ("--served-model", args.served_model, None),
                ("--prompts", args.prompts, 8),
                ("--max-tokens", args.max_tokens, 32),
                ("--temperature", args.temperature, 1.0),
            ]
            if value != default
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)} only apply with --server URL (the server's logprobs against "
                f"this trainer's); without it parity checks the model's own kernels"
            )
    if args.server:  # named before the model loads (a minute for a large one)
        _check_server_flags(args)
    model = exactrl.load_model(
        args.model, dtype=args.dtype, kernels=args.kernels, device=args.device, backend=args.backend
    )
    if args.server:
        return _server_parity(args, model, fail)
    results = run_parity(model, length=args.length, seed=args.seed)
    for r in results:
        line = f"{r.name:12s} {'exact' if r.exact else 'DIFFERS'}"
        if not r.exact:
            line += (
                f"  max|Δlogit|={r.max_abs_diff:.3e}  first divergent op: {r.first_divergent_op} (|Δ|={r.op_diff:.3e})"
            )
        print(line)
    ok = all(r.exact for r in results)
    print(f"verdict: {'BITWISE EXACT' if ok else 'NOT EXACT'} ({args.kernels} kernels, {args.dtype})")
    if args.json:
        print(json.dumps([r.__dict__ for r in results]))
    return 0 if ok else 1


def _check_server_flags(args) -> None:
    """`parity --server`: the flags that need no model, checked before it loads."""
    from exactrl.debug.parity import server_settings
    from exactrl.kernels.rowwise import check_temperature

    server_settings(args.server, args.served_model or args.model)
    try:
        check_temperature(args.temperature)
    except ValueError as e:
        raise ValueError(f"--temperature {args.temperature}: {e}") from None


def _server_parity(args, model, fail) -> int:
    """`parity --server URL`: the server's logprobs against this trainer's, on random prompts."""
    from exactrl.debug.parity import server_mismatch
    from exactrl.rollout.external import ExternalEngineError

    if args.max_tokens >= model.config.context_length:
        raise ValueError(
            f"--max-tokens {args.max_tokens} leaves no room for a prompt in the model's context of "
            f"{model.config.context_length} tokens"
        )
    length = min(args.length, model.config.context_length - args.max_tokens)
    try:
        m = server_mismatch(
            model,
            args.server,
            args.served_model or args.model,
            prompts=args.prompts,
            length=length,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
        )
    except ExternalEngineError as e:  # down, or answered an error: its message names the URL
        # in the training loop's words, which name config keys: here --server, and a timeout no flag sets
        text = str(e).replace("rollout_backend.base_url / base_urls", "--server")
        text = text.replace("rollout_backend.timeout_s=", "")
        return fail(args.command, ValueError(text))
    diff, worst = m["train/train_rollout_logprob_abs_diff"], m["train/train_rollout_logprob_abs_diff_max"]
    print(
        f"server {args.server}: {int(m['parity/tokens'])} tokens of {args.prompts} prompts ({length} prompt "
        f"tokens, T={args.temperature})"
    )
    print(f"|logprob diff|  mean {diff:.3e}  max {worst:.3e}   k3 {m['mismatch/k3']:.3e}   ess {m['mismatch/ess']:.6f}")
    tokens = int(m["parity/tokens"])
    if tokens < args.prompts * args.max_tokens:  # ignore_eos asks for every token; a server may stop early
        print(f"note: the server returned {tokens} of the {args.prompts * args.max_tokens} tokens asked for")
    ok = tokens > 0 and worst == 0.0  # no token compared proves nothing
    verdict = "BITWISE EXACT" if ok else "NOT EXACT" if tokens else "NOTHING COMPARED (no tokens returned)"
    print(
        f"verdict: {verdict} (the server vs this trainer, {args.kernels} kernels, {args.dtype}, the model at "
        f"{args.model})"
    )
    if args.json:
        print(json.dumps(m))
    return 0 if ok else 1
