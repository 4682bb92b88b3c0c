"""verl's model side, faked, for running verl 0.9.1's own v1 trainer on CPU (tests/integration/verl_loop.py).

Only what needs a GPU or a model is replaced; everything that drives the sampler is verl's::

    trainer (TaskRunner actor)                         agent loop worker (AgentLoopWorkerTQ, verl's)
      fit / step / _step_once / mode hooks (verl)        _run_prompt: status running ─┐
      _balance_batch, _compute_metrics, kv_clear          SingleTurnAgentLoop.run (verl)  │ tq writes (verl)
      ├─ FakeWorkerGroup: log probs, update_actor         └─ LLMServerClient (verl) ──▶ FakeServer.generate:
      ├─ FakeCheckpointManager ──┐                             a seeded sleep, fake token ids
      ├─ FakeLLMServerManager    ├──▶ rollout state file ◀── FakeServer / FakeLoadBalancer read it
      └─ FakeRewardLoopManager   ┘    (weights version, asleep, paused, abort epoch, in the balancer)

The trainer side is installed by :func:`install` (module attributes of verl's trainer modules, in the TaskRunner
process only). The rollout side needs no patch: the fake servers, balancer and reward handle are plain objects
that verl's own LLM client and agent loop worker receive (pickled through Ray) and call; the dataset is loaded
through verl's ``data.custom_cls``; the tokenizer is a small word-level one written by :func:`write_model`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

#: Words of the fake vocabulary; a prompt is a few of them, a response a few token ids among them.
VOCAB_WORDS = 256
_SPECIALS = ["<pad>", "<eos>", "<bos>", "<|user|>", "<|assistant|>", "<|system|>"]
#: Rows of the training set: more than any run consumes, so an epoch never ends inside a run.
TRAIN_ROWS = 4096
STATE_FILE = "rollout-state.json"
#: How often a waiting fake server (and the state watcher) looks at the rollout state.
_STATE_POLL = 0.02
_POOLS = ("hybrid", "standalone")


# -- the tokenizer and the model config ---------------------------------------------------------


def write_model(directory: str) -> str:
    """A model directory verl's ``HFModelConfig`` loads offline: a word-level tokenizer with a chat template and
    a tiny llama ``config.json`` (never instantiated). Returns ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(directory, exist_ok=True)
    vocab = {token: i for i, token in enumerate(_SPECIALS + [f"w{i}" for i in range(VOCAB_WORDS)])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                        bos_token="<bos>", unk_token="w0")
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|> {% endif %}")
    tokenizer.save_pretrained(directory)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": len(vocab),
              "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "max_position_embeddings": 1024, "bos_token_id": 2, "eos_token_id": 1,
              "pad_token_id": 0, "torch_dtype": "float32"}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


def _first_token_id() -> int:
    return len(_SPECIALS)


# -- the dataset (verl's data.custom_cls) ---------------------------------------------------------


class PromptDataset(Dataset):
    """Rows shaped like verl's ``RLHFDataset`` gives them to the agent loop (``raw_prompt`` messages, ``index``,
    ``data_source``, ``reward_model``, ``extra_info``, ...); no file is read. Row ``i`` asks a prompt no other row
    asks, so the fake server's seeded delays follow the row."""

    def __init__(self, data_files: Any, tokenizer: Any, processor: Any, config: Any, max_samples: int = -1) -> None:
        self.rows = max_samples if max_samples and max_samples > 0 else TRAIN_ROWS
        # Validation rows ask other prompts than training rows.
        self.offset = 0 if "val" not in str(data_files) else 1_000_000

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, item: int) -> dict[str, Any]:
        n = self.offset + item
        words = " ".join(f"w{(n // VOCAB_WORDS ** d) % VOCAB_WORDS}" for d in range(3))
        return {
            "data_source": "verl-loop",
            "raw_prompt": [{"role": "user", "content": f"{words} w7 w8"}],
            "reward_model": {"ground_truth": "w1", "style": "rule"},
            "extra_info": {"index": n},
            "index": n,
            "tools_kwargs": {},
            "interaction_kwargs": {},
            # verl's RLHFDataset adds it too: DataProto needs a tensor in the batch.
            "dummy_tensor": torch.tensor([0], dtype=torch.uint8),
        }


# -- the rollout state, shared by the trainer's fakes and the fake servers ------------------------


def _read_state(path: str) -> dict[str, Any]:
    with open(path) as f:
        state: dict[str, Any] = json.load(f)
    return state


def _write_state(path: str, state: dict[str, Any]) -> None:
    # Written whole and renamed: a reader in another process never sees half a file.
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(state, f)
    os.replace(temporary, path)


def reset_state(directory: str) -> str:
    """A fresh rollout state in ``directory`` (weights version 0, every pool awake, running, out of the balancer)."""
    path = os.path.join(directory, STATE_FILE)
    _write_state(path, {"version": 0, "pools": {pool: {"awake": True, "paused": False, "epoch": 0, "in_lb": False}
                                                for pool in _POOLS}})
    return path


def _update_state(path: str, pools: list[str], **changes: Any) -> None:
    """Apply ``changes`` to ``pools`` (``version`` to the whole state); only the trainer process writes."""
    state = _read_state(path)
    if "version" in changes:
        state["version"] = changes.pop("version")
    abort = changes.pop("abort", False)
    for pool in pools:
        entry = state["pools"][pool]
        entry["epoch"] += 1 if abort else 0
        entry.update(changes)
    _write_state(path, state)


class _StateWatcher:
    """The rollout state as one agent-loop process sees it: the file re-read when it changed, every 20 ms."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.state = _read_state(path)
        self._stamp = os.stat(path).st_mtime_ns
        self._checked = time.monotonic()

    def current(self) -> dict[str, Any]:
        now = time.monotonic()
        if now - self._checked >= _STATE_POLL:
            self._checked = now
            stamp = os.stat(self.path).st_mtime_ns
            if stamp != self._stamp:
                self._stamp = stamp
                self.state = _read_state(self.path)
        return self.state


_watchers: dict[str, _StateWatcher] = {}


def _watcher(path: str) -> _StateWatcher:
    if path not in _watchers:
        _watchers[path] = _StateWatcher(path)
    return _watchers[path]


# -- the LLM servers and their load balancer (called by verl's LLMServerClient) ---------------------


@dataclass(frozen=True)
class RolloutSettings:
    """What the fake servers draw from: the LLM call's duration range, the response length range, the share of
    calls that fail, and the seed."""

    state_path: str
    seed: int = 0
    delay: tuple[float, float] = (0.1, 1.2)
    response_tokens: tuple[int, int] = (4, 24)
    failure_rate: float = 0.0


class _Remote:
    """``handle.method.remote(...)`` for a fake handle: a coroutine where verl awaits the result (agent loop), an
    object reference where it ``ray.get``s it (the trainer), ``None`` where it fires and forgets."""

    def __init__(self, function: Any, kind: str) -> None:
        self._function = function
        self._kind = kind

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self._kind == "await":
            return self._function(*args, **kwargs)
        result = self._function(*args, **kwargs)
        if self._kind == "get":
            import ray

            return ray.put(result)
        return None


class FakeServer:
    """One replica's server: ``generate`` is the LLM call, replaced by a seeded sleep returning fake token ids.

    It waits while its pool is asleep or paused (verl's colocated replicas between ``abort``/``sleep`` and
    ``update_weights``/``resume``), and a generation under way when its pool is aborted stops with
    ``stop_reason="aborted"`` and the tokens drawn so far, which verl's ``FullyAsyncLLMServerClient`` resumes.
    ``extra_fields["global_steps"]`` is the weights version the pool holds when it returns.
    """

    def __init__(self, pool: str, settings: RolloutSettings) -> None:
        self.pool = pool
        self.settings = settings
        self.generate = _Remote(self._generate, "await")

    async def _generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                        **kwargs: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        rng = _draw(self.settings.seed, prompt_ids)
        settings = self.settings
        duration = rng.uniform(*settings.delay)
        tokens = rng.randint(*settings.response_tokens)
        limit = sampling_params.get("max_tokens")
        if isinstance(limit, int) and limit >= 0:
            tokens = min(tokens, limit)
        fails = rng.random() < settings.failure_rate
        watcher = _watcher(settings.state_path)
        while not _serving(watcher.current(), self.pool):
            await asyncio.sleep(_STATE_POLL)
        epoch = watcher.current()["pools"][self.pool]["epoch"]
        started = time.monotonic()
        aborted = False
        while (left := duration - (time.monotonic() - started)) > 0:
            await asyncio.sleep(min(left, _STATE_POLL))
            if watcher.current()["pools"][self.pool]["epoch"] != epoch:
                aborted = True
                break
        if fails and not aborted:
            raise RuntimeError("injected LLM failure (verl_loop_fakes)")
        if aborted:
            tokens = int(tokens * min(1.0, (time.monotonic() - started) / duration))
        ids = [_first_token_id() + rng.randrange(VOCAB_WORDS) for _ in range(tokens)]
        log_probs = [-rng.random() for _ in ids] if sampling_params.get("logprobs") else None
        return TokenOutput(token_ids=ids, log_probs=log_probs, stop_reason="aborted" if aborted else "completed",
                           num_preempted=0, extra_fields={"global_steps": watcher.current()["version"]})


_calls: dict[int, int] = {}


def _draw(seed: int, prompt_ids: list[int]) -> random.Random:
    """The random source of one LLM call: the prompt's ids and how many calls this process made with them (the
    n sessions of a group start in order), so a run draws the same delays whatever samples it."""
    digest = zlib.crc32(json.dumps([int(i) for i in prompt_ids]).encode())
    nth = _calls.get(digest, 0)
    _calls[digest] = nth + 1
    return random.Random(f"{seed}:{digest}:{nth}")


def _serving(state: dict[str, Any], pool: str) -> bool:
    entry = state["pools"][pool]
    return bool(entry["awake"] and not entry["paused"])


class FakeLoadBalancer:
    """verl's global load balancer, as its LLM client and its separate-async trainer call it: ``acquire_server``
    routes to the pool in the balancer with the fewest requests this process has in flight there."""

    def __init__(self, servers: dict[str, FakeServer], settings: RolloutSettings) -> None:
        self._servers = dict(servers)
        self._settings = settings
        self._in_flight: dict[str, int] = {}
        self.require_acquire_fields = _Remote(self._no_fields, "await")
        self.require_release_fields = _Remote(self._no_fields, "await")
        self.acquire_server = _Remote(self._acquire, "await")
        self.release_server = _Remote(self._release, "fire")
        self.add_servers = _Remote(self._add, "get")
        self.remove_servers = _Remote(self._remove, "get")
        self.clear_sticky_cache = _Remote(lambda: {}, "get")

    async def _no_fields(self) -> list[str]:
        return []

    async def _acquire(self, request_id: str, **fields: Any) -> tuple[str, FakeServer]:
        state = _watcher(self._settings.state_path).current()
        while True:
            pools = [p for p, server in self._servers.items() if state["pools"][server.pool]["in_lb"]]
            if pools:
                break
            # verl's balancer raises when empty; its hybrid-only client retries every second.
            await asyncio.sleep(_STATE_POLL)
            state = _watcher(self._settings.state_path).current()
        address = min(pools, key=lambda p: self._in_flight.get(p, 0))
        self._in_flight[address] = self._in_flight.get(address, 0) + 1
        return address, self._servers[address]

    def _release(self, server_id: str, **fields: Any) -> None:
        self._in_flight[server_id] = max(0, self._in_flight.get(server_id, 0) - 1)

    def _add(self, servers: dict[str, Any]) -> None:
        for address, server in servers.items():
            self._servers[address] = server
            _update_state(self._settings.state_path, [server.pool], in_lb=True)

    def _remove(self, addresses: list[str]) -> None:
        for address in addresses:
            server = self._servers.get(address)
            if server is not None:
                _update_state(self._settings.state_path, [server.pool], in_lb=False)


@dataclass
class FakeReplica:
    """A rollout replica as the checkpoint engine manager holds it: which pool it is."""

    pool: str
    replica_rank: int = 0


class FakeLLMServerManager:
    """verl's ``LLMServerManager``: the replicas of one pool (hybrid: on the trainer's GPUs; standalone: separate
    async's own), their balancer and clients of verl's own classes."""

    settings: RolloutSettings  # set by install()

    def __init__(self, config: Any, pool: str | None) -> None:
        self.config = config
        pools = [pool] if pool else []
        self.rollout_replicas = [FakeReplica(p) for p in pools]
        self.server_addresses = [f"fake-{p}:0" for p in pools]
        self.server_handles = [FakeServer(p, self.settings) for p in pools]
        self.global_load_balancer = FakeLoadBalancer(dict(zip(self.server_addresses, self.server_handles)),
                                                     self.settings)
        if pools:
            _update_state(self.settings.state_path, pools, in_lb=True)

    @classmethod
    def create(cls, config: Any, worker_group: Any = None, rollout_resource_pool: Any = None,
               start_rank: int | None = None, **kwargs: Any) -> FakeLLMServerManager:
        # verl creates the trainer's (hybrid) replicas with its worker group, separate async's with a start rank.
        return cls(config, "hybrid" if worker_group is not None else "standalone")

    @classmethod
    def create_empty(cls, config: Any, **kwargs: Any) -> FakeLLMServerManager:
        return cls(config, None)

    def get_client(self, client_cls: Any = None, **kwargs: Any) -> Any:
        from verl.workers.rollout.llm_server import LLMServerClient

        client: Any = client_cls or LLMServerClient
        return client(config=self.config, load_balancer_handle=self.global_load_balancer, **kwargs)

    def get_addresses(self) -> list[str]:
        return self.server_addresses

    def get_replicas(self) -> list[FakeReplica]:
        return self.rollout_replicas

    def start_profile(self, **kwargs: Any) -> None:
        return None

    def stop_profile(self) -> None:
        return None


class FakeCheckpointManager:
    """verl's ``CheckpointEngineManager`` over one pool's replicas: weight sync, sleep, abort and resume change
    the rollout state the fake servers act on; a weight sync costs ``sync_seconds``."""

    settings: RolloutSettings  # set by install()
    sync_seconds = 0.05

    def __init__(self, config: Any = None, actor_wg: Any = None, replicas: list[FakeReplica] | None = None,
                 **kwargs: Any) -> None:
        self.pools = sorted({replica.pool for replica in replicas or []})

    def update_weights(self, global_steps: int | None = None, **kwargs: Any) -> dict[str, Any]:
        time.sleep(self.sync_seconds)
        changes: dict[str, Any] = {"awake": True}
        if global_steps is not None:
            changes["version"] = int(global_steps)
        _update_state(self.settings.state_path, self.pools, **changes)
        return {}

    def sleep_replicas(self) -> None:
        _update_state(self.settings.state_path, self.pools, awake=False)

    def abort_replicas(self, reject_request: bool = False) -> None:
        _update_state(self.settings.state_path, self.pools, abort=True, paused=True)

    def resume_generation_replicas(self) -> None:
        _update_state(self.settings.state_path, self.pools, paused=False)


# -- the reward loop --------------------------------------------------------------------------------


class FakeRewardHandle:
    """A reward loop worker handle as verl's agent loop worker calls it (``await handle.compute_score.remote(data)``):
    a 0/1 score drawn from the response's tokens."""

    def __init__(self) -> None:
        self.compute_score = _Remote(self._score, "await")

    async def _score(self, data: Any) -> dict[str, Any]:
        responses = data.batch["responses"]
        score = float(zlib.crc32(responses.numpy().tobytes()) % 2)
        return {"reward_score": score, "reward_extra_info": {"acc": score}}


class FakeRewardLoopManager:
    """verl's ``RewardLoopManager`` with rule-based reward: its worker handles go to the agent loop."""

    def __init__(self, config: Any = None, rm_resource_pool: Any = None, **kwargs: Any) -> None:
        self.reward_loop_worker_handles = [FakeRewardHandle()]


# -- the worker groups --------------------------------------------------------------------------------


class FakeWorkerGroup:
    """The actor (and reference) worker group verl's trainer calls: each call reads from TransferQueue what the
    real worker reads and writes what verl reads next (``log_probs``, ``entropy``), and returns what verl expects.

    ``update_actor`` stands for a training step: it sleeps ``train_seconds``.
    """

    train_seconds = 0.3
    infer_seconds = 0.02

    def __init__(self, role: str) -> None:
        self.role = role
        self._dispatch_info: dict[str, list[int]] = {}
        self.calls: list[str] = []

    def _query_dispatch_info(self, role: str) -> list[int]:
        return [0]  # one data-parallel rank (trainer.n_gpus_per_node=1)

    def init_model(self) -> None:
        self.calls.append("init_model")

    def compute_log_prob(self, batch: Any) -> Any:
        return self._log_probs(batch, entropy=True)

    def compute_ref_log_prob(self, batch: Any) -> Any:
        return self._log_probs(batch, entropy=False)

    def _log_probs(self, batch: Any, entropy: bool) -> Any:
        """Write per-token ``log_probs`` (and ``entropy``) over each whole sequence, as the real worker does."""
        import transfer_queue as tq
        from tensordict import TensorDict

        self.calls.append("compute_log_prob" if entropy else "compute_ref_log_prob")
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["input_ids"])
        lengths = data["input_ids"].offsets().diff().tolist()
        generator = torch.Generator().manual_seed(len(batch.keys))
        fields = {"log_probs": _nested([-torch.rand(n, generator=generator) for n in lengths])}
        if entropy:
            fields["entropy"] = _nested([torch.rand(n, generator=generator) for n in lengths])
        time.sleep(self.infer_seconds)
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                        fields=TensorDict(fields, batch_size=len(batch.keys)))
        return batch

    def update_actor(self, batch: Any) -> Any:
        """Read the fields a PPO update reads, "train", and return the real worker's metrics shape."""
        import transfer_queue as tq
        from verl.utils import tensordict_utils as tu

        self.calls.append("update_actor")
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["advantages", "old_log_probs", "response_mask"])
        advantages = data["advantages"].values()
        time.sleep(self.train_seconds)
        metrics = {"pg_loss": [float(-advantages.mean()) if advantages.numel() else 0.0], "grad_norm": [1.0],
                   "lr": [1e-6], "mfu": [0.0]}
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})

    # separate async saves and restores the old policy around its log-prob pass; checkpoints and profiling.
    def save_model_to_cpu(self, n: int) -> None:
        self.calls.append("save_model_to_cpu")

    def restore_model_from_cpu(self, n: int) -> None:
        self.calls.append("restore_model_from_cpu")

    def clear_cpu_model(self, n: int) -> None:
        self.calls.append("clear_cpu_model")

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        return None

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        return None

    def start_profile(self, **kwargs: Any) -> None:
        return None

    def stop_profile(self, **kwargs: Any) -> None:
        return None


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


class FakeWorkerGroupDict:
    """``RayWorkerGroup(resource_pool, ray_cls_with_init, ...)``: ``spawn`` gives a worker group per role."""

    def __init__(self, resource_pool: Any = None, ray_cls_with_init: Any = None, **kwargs: Any) -> None:
        self.roles = list(ray_cls_with_init or [])

    def spawn(self, prefix_set: Any) -> dict[str, FakeWorkerGroup]:
        return {role: FakeWorkerGroup(role) for role in prefix_set}


def _colocated(class_dict: dict[str, Any]) -> dict[str, Any]:
    return class_dict  # verl builds a fused Ray actor class here; the fake worker groups need the role names only


# -- installing the trainer side ------------------------------------------------------------------------


def install(settings: RolloutSettings, train_seconds: float | None = None) -> None:
    """Replace, in this process (verl's TaskRunner), the names verl's trainer modules build their model side with.

    Nothing of the trainer's loop, the sampler's calls, the batch balancing, the metrics or the clears changes.
    """
    from verl.trainer.ppo.v1 import trainer_base, trainer_separate_async

    FakeLLMServerManager.settings = settings
    FakeCheckpointManager.settings = settings
    if train_seconds is not None:
        FakeWorkerGroup.train_seconds = train_seconds
    replaced: dict[Any, dict[str, Any]] = {
        trainer_base: {"RayWorkerGroup": FakeWorkerGroupDict, "create_colocated_worker_cls": _colocated,
                       "RewardLoopManager": FakeRewardLoopManager, "LLMServerManager": FakeLLMServerManager,
                       "CheckpointEngineManager": FakeCheckpointManager},
        trainer_separate_async: {"LLMServerManager": FakeLLMServerManager,
                                 "CheckpointEngineManager": FakeCheckpointManager},
    }
    for module, names in replaced.items():
        for name, fake in names.items():
            assert hasattr(module, name), f"verl's {module.__name__} has no {name} any more"
            setattr(module, name, fake)
