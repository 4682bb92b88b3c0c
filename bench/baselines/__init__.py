"""What the product is measured against, each in the same run.

* :mod:`.thread`: the in-trainer poller thread the product replaces.
* :mod:`.mpqueue`: a child process sending the full listing through a
  ``multiprocessing.Queue`` every poll.
* :mod:`.ceiling`: raw pyzmq ipc with pre-packed msgpack messages.
* :mod:`.floors`: a bare interpreter spawn, and SIGKILL-and-reap.
"""
