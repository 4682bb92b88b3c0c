"""The verl sampler's configuration: constructor arguments and ``sampler_kwargs``, checked.

verl builds a custom sampler with six keywords only (``trainer_mode``,
``trainer_config``, ``max_off_policy_threshold``, ``max_off_policy_strategy``,
``sampler_kwargs``, ``refill_fn``), so every other option may also come from
``sampler_kwargs``. An option given both ways must agree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from poller.common.checks import check_count, check_optional_seconds, check_seconds
from poller.sources.contract import SourceSpec

__all__ = ["SamplerConfig", "DEFAULT_POLL_INTERVAL", "SAMPLER_KWARGS", "VERL_ATTRIBUTES", "VerlConfigError"]

logger = logging.getLogger(__name__)

#: Seconds between two listings of the store while a call waits, when neither the constructor nor sampler_kwargs
#: say: verl 0.9.1's own sampler's default, which verl's trainer also reads (its hybrid switch judges a step idle
#: when sampling waited longer than this).
DEFAULT_POLL_INTERVAL = 2.0

#: The constructor's options that sampler_kwargs may carry too, with their defaults.
_SHARED = {"poll_interval": None, "filter_groups_metric": None, "train_batch_size": None, "gen_batch_size": None,
           "max_inflight_gen_batches": 1, "sync_refill_failed_groups": False}
#: Options only sampler_kwargs carries, with their defaults.
_OWN = {"sample_timeout": None, "log_interval": 60.0, "source": None, "source_kwargs": None, "start_timeout": 30.0,
        "close_timeout": 5.0, "max_restarts": 3}
#: Every key sampler_kwargs may hold.
SAMPLER_KWARGS = frozenset(_SHARED) | frozenset(_OWN)
#: The options the sampler passes on to its buffer.
_BUFFER_OPTIONS = ("start_timeout", "close_timeout", "max_restarts")
#: verl's sampler attributes, read from the options record (``ReplayBuffer.__getattr__``).
VERL_ATTRIBUTES = frozenset(_SHARED) | {"trainer_mode", "max_off_policy_threshold", "max_off_policy_strategy",
                                        "refill_fn"}


class VerlConfigError(ValueError, AssertionError):
    """A sampler option refused, worded as verl 0.9.1 words it; every configuration error of the sampler.

    Both classes verl 0.9.1 raises: it ``assert``s its threshold and strategy, ``ValueError`` for the rest.
    """


def plain(value: Any) -> Any:
    """``value`` with every mapping and list made a plain dict / list (verl passes OmegaConf containers)."""
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [plain(item) for item in value]
    return value


@dataclass(frozen=True)
class SamplerConfig:
    """Everything the sampler was configured with, checked."""

    trainer_mode: str
    asynchronous: bool
    max_off_policy_threshold: int | None
    max_off_policy_strategy: str
    refill_fn: Callable[[int], Any] | None
    poll_interval: float
    filter_groups_metric: str | None
    train_batch_size: int | None
    gen_batch_size: int | None
    max_inflight_gen_batches: int
    sync_refill_failed_groups: bool
    sample_timeout: float | None
    log_interval: float
    source: SourceSpec | None
    source_kwargs: dict[str, Any] | None
    buffer_kwargs: dict[str, Any] = field(default_factory=dict)

    def dapo_on(self, partition_id: str) -> bool:
        """Whether DAPO group filtering applies to ``partition_id`` (never to validation)."""
        return partition_id != "val" and self.filter_groups_metric is not None

    @classmethod
    def resolve(cls, *, asynchronous: bool, trainer_mode: Any, max_off_policy_threshold: Any,
                max_off_policy_strategy: Any, sampler_kwargs: Any, refill_fn: Any,
                given: Mapping[str, Any]) -> SamplerConfig:
        """Check and merge (raising as :class:`~buffer.verl.ReplayBuffer` documents).

        ``given`` holds the shared options as the constructor received them.
        """
        if not isinstance(trainer_mode, str) or not trainer_mode:
            raise VerlConfigError(f"trainer_mode must be a non-empty string such as 'sync', got {trainer_mode!r}")
        if max_off_policy_threshold is None:
            # verl 0.9.1 logs this at INFO on every construction, with these words.
            logger.info("[V1ReplayBuffer] off-policy version control disabled (max_off_policy_threshold is null): "
                        "no samples will be dropped or awaited for staleness")
        elif (not isinstance(max_off_policy_threshold, int) or isinstance(max_off_policy_threshold, bool)
                or max_off_policy_threshold <= 0):
            raise VerlConfigError(f"Invalid max off policy threshold: {max_off_policy_threshold}, must be an integer "
                                  "greater than 0, or null to disable off-policy version control")
        if max_off_policy_strategy not in ("drop", "wait"):
            raise VerlConfigError(f"Invalid max off policy strategy: {max_off_policy_strategy}, "
                                  "must be one of ['drop', 'wait']")
        if sampler_kwargs is not None and not isinstance(sampler_kwargs, Mapping):
            raise TypeError(f"sampler_kwargs must be a mapping, got {type(sampler_kwargs).__name__}")
        kwargs = plain(sampler_kwargs or {})
        unknown = sorted(set(kwargs) - SAMPLER_KWARGS)
        if unknown:
            raise VerlConfigError(f"unknown sampler_kwargs {unknown}; known: {sorted(SAMPLER_KWARGS)}")
        if refill_fn is not None and not callable(refill_fn):
            raise TypeError(f"refill_fn must be callable, got {type(refill_fn).__name__}")
        options = {name: _pick(name, default, given.get(name, default), kwargs) for name, default in _SHARED.items()}
        options.update((name, kwargs.get(name, default)) for name, default in _OWN.items())
        if options["poll_interval"] is None:
            options["poll_interval"] = DEFAULT_POLL_INTERVAL
        buffer_kwargs = {name: options.pop(name) for name in _BUFFER_OPTIONS}
        config = cls(trainer_mode=trainer_mode, asynchronous=asynchronous,
                     max_off_policy_threshold=max_off_policy_threshold,
                     max_off_policy_strategy=max_off_policy_strategy, refill_fn=refill_fn,
                     buffer_kwargs=buffer_kwargs, **options)
        try:
            config._check()
        except ValueError as exc:  # poller.common.checks' checks too: one class for every configuration error
            raise exc if isinstance(exc, VerlConfigError) else VerlConfigError(str(exc)) from None
        return config

    def _check(self) -> None:
        check_seconds("poll_interval", self.poll_interval)
        check_optional_seconds("sample_timeout", self.sample_timeout)
        for name, seconds in (("log_interval", self.log_interval),
                              ("start_timeout", self.buffer_kwargs["start_timeout"]),
                              ("close_timeout", self.buffer_kwargs["close_timeout"])):
            check_seconds(name, seconds)
        check_count("max_restarts", self.buffer_kwargs["max_restarts"])
        metric = self.filter_groups_metric
        if metric is not None and (not isinstance(metric, str) or not metric):
            raise VerlConfigError(f"filter_groups_metric must be a non-empty string or None, got {metric!r}")
        if not isinstance(self.sync_refill_failed_groups, bool):
            raise VerlConfigError(f"sync_refill_failed_groups must be a bool, got {self.sync_refill_failed_groups!r}")
        for name, size in (("train_batch_size", self.train_batch_size), ("gen_batch_size", self.gen_batch_size)):
            if size is not None:
                check_count(name, size, minimum=1)
        if metric is not None and self.refill_fn is None:
            raise VerlConfigError("Group filtering (filter_groups_metric) requires refill_fn to replace evicted groups")
        if self.sync_refill_failed_groups and self.refill_fn is None:
            raise VerlConfigError("sync_refill_failed_groups requires refill_fn to replace failed groups")
        if self.source is not None and not (isinstance(self.source, str) or callable(self.source)):
            raise VerlConfigError(f"source must be a 'package.module:attr' spec or a callable, got {self.source!r}")
        if self.source_kwargs is not None and not isinstance(self.source_kwargs, dict):
            raise VerlConfigError(f"source_kwargs must be a mapping, got {self.source_kwargs!r}")
        if self.asynchronous:
            return
        # Sync mode only (verl's _validate_mode_config).
        if metric is not None:
            inflight = self.max_inflight_gen_batches
            if not isinstance(inflight, int) or isinstance(inflight, bool) or inflight <= 0:
                raise VerlConfigError("max_inflight_gen_batches must be a positive integer")
            if self.train_batch_size is None or self.gen_batch_size is None:
                raise VerlConfigError("sync group filtering (filter_groups_metric) needs train_batch_size and "
                                 "gen_batch_size (in sampler_kwargs when verl builds a custom sampler)")
        if self.sync_refill_failed_groups and self.gen_batch_size != 1:
            raise VerlConfigError(f"sync_refill_failed_groups requires gen_batch_size=1, got {self.gen_batch_size!r}")


def _pick(name: str, default: Any, argument: Any, kwargs: Mapping[str, Any]) -> Any:
    """The constructor's value unless it is the default; sampler_kwargs otherwise. Both set: must agree."""
    if name not in kwargs:
        return argument
    if argument is not default and argument != default and kwargs[name] != argument:
        raise VerlConfigError(f"{name} is given twice with different values: {argument!r} as an argument and "
                         f"{kwargs[name]!r} in sampler_kwargs")
    return kwargs[name]
