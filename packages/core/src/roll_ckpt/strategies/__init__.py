"""Strategies: a training state turned into a checkpoint's files and back.

:mod:`.dcp` holds core's ``dcp`` strategy (:class:`~roll_ckpt.strategies.dcp.DCPStrategy`), which
plugins subclass (``fsdp2``); the ``json`` strategy of driver states is
:mod:`roll_ckpt.format.driver_state`'s. The contract they fulfil is
:class:`roll_ckpt.contracts.Strategy`.

Layer 9, the top room of the layering (the assembly and ``cli``/``testing`` sit above the rooms):
imports ``save``, ``load`` and every room below; nothing below imports it (the registry,
``roll_ckpt._builtin`` and ``roll_ckpt.plugin``, build it on first use).
"""
