"""roll/distributed/strategy/factory.py: create_strategy, for "fsdp2_train" only (ROLL also
knows hf_infer, vllm, sglang, megatron_*, mock_infer and fsdp2_infer)."""


def create_strategy(worker, sync_wrapper: bool = False):
    strategy_name = worker.worker_config.strategy_args.strategy_name
    # Imported lazily, as ROLL does.
    if strategy_name == "fsdp2_train":
        from roll.distributed.strategy.fsdp2_strategy import FSDP2TrainStrategy as strategy_cls
    else:
        raise ValueError(f"Unknown strategy name: {strategy_name} (the ROLL double has fsdp2_train only)")
    return strategy_cls(worker)
