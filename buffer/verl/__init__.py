"""A drop-in sampler for verl's v1 trainers, fed by the isolated poller (runs in the trainer process).

::

    trainer.v1.sampler.custom_sampler.path: pkg://buffer.verl
    trainer.v1.sampler.custom_sampler.name: ReplayBuffer

verl's own sampler lists the whole store in the trainer's thread at the start of
every call and sleeps ``poll_interval`` between tries. Here the poller lists the
store in its own process at the same moments and streams what changed into a
group index; each decision of the rules over it (both in :mod:`.groups`) sees
one consistent view under the store's lock, and a wait wakes on the change that
completes it: the poller reads the prompts a call waits on and lists as soon as
one finished, within ``poll_interval``::

    sample() ── decide (store lock) ─▶ Plan ── clear / refill_fn / read DAPO metrics (no lock)
       ▲                                │        then sync(): the next view reflects them
       └──── wake on change ◀── store ◀─┘◀── poller process (kv_list, diff) ◀── TransferQueue

:mod:`.sampler` holds the classes, :mod:`.config` their options, :mod:`.store` their buffer and client.
"""

from buffer.verl.config import VerlConfigError
from buffer.verl.groups import DAPO_FILTERED_REWARD_COUNTS_KEY
from buffer.verl.sampler import WATCHED_PROMPTS as WATCHED_PROMPTS
from buffer.verl.sampler import ReplayBuffer, ReplayBufferAsync, VerlBatch

__all__ = ["DAPO_FILTERED_REWARD_COUNTS_KEY", "ReplayBuffer", "ReplayBufferAsync", "VerlBatch", "VerlConfigError"]
