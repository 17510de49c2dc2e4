"""Collective communication on torch.distributed: cluster membership, groups, collectives, autograd-aware ops."""
from autopar.comm.functional import (  # noqa: F401
    ReduceOp,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    reduce_scatter,
)
from autopar.comm.management import (  # noqa: F401
    GlobalComm,
    create_group,
    destroy_group,
    get_group_rank_from_world_rank,
    get_group_size,
    get_local_rank,
    get_local_size,
    get_process_group,
    get_rank,
    get_world_rank_from_group_rank,
    init,
    is_initialized,
    release,
)
