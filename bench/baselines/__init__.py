"""What the product is measured against, each in the same run.

* :mod:`.thread`: the in-trainer poller thread the product replaces.
* :mod:`.mpqueue`: a child process sending the full listing through a
  ``multiprocessing.Queue`` every poll.
* :mod:`.ceiling`: raw pyzmq ipc with pre-packed msgpack messages.
* :mod:`.floors`: a bare interpreter spawn, and SIGKILL-and-reap.
"""

from typing import Any, Mapping


def merge_listing(partitions: dict[str, dict[str, Any]], listing: Mapping[str, Mapping[str, Any]],
                  copy: bool = True) -> None:
    """Merge a full ``kv_list()`` answer into ``partitions`` the way verl's old poller thread did: no deletes.

    ``copy=False`` keeps a new key's tags dict as it is (one that came through a queue is the caller's own).
    """
    for partition_id, items in listing.items():
        part = partitions.setdefault(partition_id, {})
        for key, tags in items.items():
            current = part.get(key)
            if current is None:
                part[key] = dict(tags) if copy else tags
            else:
                current.update(tags)
