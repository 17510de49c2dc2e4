"""MindSpore door ``autopar.communication`` (= ``mindspore.communication``): aliases of :mod:`autopar.comm`."""
from autopar.comm.management import (  # noqa: F401
    GlobalComm,
    create_group,
    destroy_group,
    get_group_rank_from_world_rank,
    get_group_size,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_rank_from_group_rank,
    init,
    release,
)
from autopar.communication import comm_func  # noqa: E402,F401  (mindspore.communication.comm_func)

HCCL_WORLD_COMM_GROUP = NCCL_WORLD_COMM_GROUP = MCCL_WORLD_COMM_GROUP = GlobalComm.WORLD_COMM_GROUP
