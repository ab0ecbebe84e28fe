"""The pretrain recipe on a worker whose disk is full from the moment it takes the checkpoint lock
(test_last_faults.py).

RLIMIT_FSIZE 0 makes the kernel refuse every write to a regular file with EFBIG (Python ignores SIGXFSZ), so
the lock's first write fails for real. The limit starts at the lock, not before: the imports and the model
build that come first may write caches, which a full disk would also have refused but which are not the case
under test. Output to the terminal (a pipe) is not a file and still works.
"""

import resource
import sys

import elixir_tune
from elixir_tune.recipes import pretrain
from elixir_tune.worker_exit import exit_worker

take_lock = elixir_tune.lock_checkpoint_dir


def lock_on_a_full_disk(path, model):
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    take_lock(path, model)


elixir_tune.lock_checkpoint_dir = lock_on_a_full_disk
exit_worker(pretrain.main(sys.argv[1:]))
