"""`distributed.strategy` / `distributed.checkpoint`: the values, what fsdp refuses, the keys it makes moot."""

from __future__ import annotations

import pytest

from exactrl.distributed import Ranks
from exactrl.train.config import ignored_settings, load_config
from exactrl.train.setup import check_ranks


def test_the_strategy_defaults_to_ddp_with_full_checkpoints_and_refuses_other_values():
    cfg = load_config()
    assert (cfg.distributed.strategy, cfg.distributed.checkpoint) == ("ddp", "full")
    with pytest.raises(ValueError, match="distributed.strategy"):
        load_config(None, ["distributed.strategy=zero3"])
    with pytest.raises(ValueError, match="distributed.checkpoint"):
        load_config(None, ["distributed.checkpoint=gathered"])


@pytest.mark.parametrize(
    "key, value", [("model.lora.rank", "4"), ("async.enabled", "true"), ("distill.teacher", "initial")]
)
def test_fsdp_refuses_what_it_does_not_shard_naming_the_key(key, value):
    cfg = load_config(None, ["distributed.strategy=fsdp", f"{key}={value}"])
    with pytest.raises(ValueError, match=f"{key} with distributed.strategy=fsdp is not supported"):
        check_ranks(cfg, Ranks(0, 2))
    check_ranks(load_config(None, [f"{key}={value}"]), Ranks(0, 2))  # ddp takes it
    check_ranks(cfg, Ranks())  # one process: the strategy has no effect


def test_the_keys_fsdp_makes_moot_are_named():
    assert ignored_settings(load_config(None, ["distributed.checkpoint=sharded"])) == [
        "distributed.checkpoint has no effect: distributed.strategy is ddp"
    ]
    assert ignored_settings(load_config(None, ["distributed.strategy=fsdp", "optim.shard_state=true"])) == [
        "optim.shard_state has no effect: distributed.strategy is fsdp (AdamW's state is sharded)"
    ]
