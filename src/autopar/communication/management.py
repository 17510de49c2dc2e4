"""``mindspore.communication.management`` path (older tutorials import from here)."""
from autopar.communication import *  # noqa: F401,F403
from autopar.communication import (  # noqa: F401
    GlobalComm,
    create_group,
    destroy_group,
    get_group_size,
    get_local_rank,
    get_local_size,
    get_rank,
    init,
    release,
)
