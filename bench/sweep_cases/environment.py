"""The launch contracts' environment (MindSpore dynamic cluster, rank table, torchrun, OpenMPI, SLURM, Kubernetes)
set wrong, and rendezvous that cannot complete."""
import json

from sweep_core import PYTHON, Verdict, case

INIT = "import autopar\nautopar.init()\nprint('rank', autopar.get_rank(), 'of', autopar.get_group_size(), flush=True)\n"


def _rank_table(ctx, n=2):
    devices = [{"device_id": str(d), "device_ip": f"192.1.27.{d}", "rank_id": str(d)} for d in range(n)]
    path = ctx.path("rank_table.json")
    path.write_text(json.dumps({"version": "1.0", "server_count": "1", "status": "completed", "server_list": [
        {"server_id": "127.0.0.1", "device": devices, "host_nic_ip": "reserve"}]}))
    return path


MS = {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "MS_SCHED_HOST": "127.0.0.1"}
BAD_ENV = [
    ("MS_ROLE=MS_BOSS", {**MS, "MS_ROLE": "MS_BOSS", "MS_SCHED_PORT": "1234"}),
    ("MS_ROLE=MS_PSERVER", {**MS, "MS_ROLE": "MS_PSERVER", "MS_SCHED_PORT": "1234"}),
    ("MS_WORKER_NUM=abc", {**MS, "MS_WORKER_NUM": "abc", "MS_SCHED_PORT": "1234"}),
    ("MS_WORKER_NUM=0", {**MS, "MS_WORKER_NUM": "0", "MS_SCHED_PORT": "1234"}),
    ("MS_SCHED_PORT=70000", {**MS, "MS_SCHED_PORT": "70000"}),
    ("MS_SCHED_PORT=abc", {**MS, "MS_SCHED_PORT": "abc"}),
    ("MS_SCHED_PORT unset", dict(MS)),
    ("RANK beyond WORLD_SIZE", {"RANK": "4", "WORLD_SIZE": "2"}),
    ("RANK=abc", {"RANK": "abc", "WORLD_SIZE": "2"}),
    ("WORLD_SIZE=0", {"RANK": "0", "WORLD_SIZE": "0"}),
    ("MASTER_PORT=99999 (torchrun)", {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "99999"}),
    ("RANK_TABLE_FILE missing", {"RANK_TABLE_FILE": "/nonexistent/rank_table.json", "RANK_ID": "0"}),
    ("OMPI rank beyond size", {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "2"}),
    ("SLURM_NTASKS=0", {"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}),
    ("k8s indexed job without MASTER_ADDR", {"JOB_COMPLETION_INDEX": "0", "WORLD_SIZE": "2"}),
    ("AUTOPAR_CLUSTER_TIMEOUT=abc", {**MS, "MS_SCHED_PORT": "1234", "AUTOPAR_CLUSTER_TIMEOUT": "abc"}),
    ("AUTOPAR_CLUSTER_TIMEOUT=-5", {**MS, "MS_SCHED_PORT": "1234", "AUTOPAR_CLUSTER_TIMEOUT": "-5"}),
]

for _name, _env in BAD_ENV:
    def _fn(ctx, env=_env):
        return ctx.python(INIT, **env)
    case("environment", _name)(_fn)


@case("environment", "rank table: RANK_ID beyond the table")
def rank_id_beyond(ctx):
    return ctx.python(INIT, RANK_TABLE_FILE=_rank_table(ctx), RANK_ID="7")


@case("environment", "rank table: not JSON")
def rank_table_garbage(ctx):
    path = ctx.path("bad.json")
    path.write_text("{not json")
    return ctx.python(INIT, RANK_TABLE_FILE=path, RANK_ID="0")


@case("environment", "worker with no scheduler (no C++ dumps, ends at the timeout)")
def no_scheduler(ctx):
    run = ctx.python(INIT, limit=40, **MS, MS_SCHED_PORT=ctx.free_port(), AUTOPAR_CLUSTER_TIMEOUT="8")
    return run


@case("environment", "scheduler alone (no worker comes)")
def scheduler_alone(ctx):
    return ctx.python(INIT, limit=40, **{**MS, "MS_ROLE": "MS_SCHED"}, MS_SCHED_PORT=ctx.free_port(),
                      AUTOPAR_CLUSTER_TIMEOUT="6")


@case("environment", "worker with a wrong job token is refused")
def wrong_token(ctx):
    port = ctx.free_port()
    script = ctx.script(INIT)
    sched = ctx.start([PYTHON, str(script)], ctx.env(**{**MS, "MS_ROLE": "MS_SCHED"}, MS_SCHED_PORT=port,
                                                     AUTOPAR_JOB_TOKEN="a" * 32, AUTOPAR_CLUSTER_TIMEOUT="15"))
    try:
        return ctx.run([PYTHON, str(script)], 40, ctx.env(**MS, MS_SCHED_PORT=port, AUTOPAR_JOB_TOKEN="b" * 32))
    finally:
        sched.kill()
        sched.communicate()


@case("environment", "worker announcing another MS_WORKER_NUM than the scheduler")
def worker_num_mismatch(ctx):
    port = ctx.free_port()
    script = ctx.script(INIT)
    sched = ctx.start([PYTHON, str(script)], ctx.env(**{**MS, "MS_ROLE": "MS_SCHED"}, MS_SCHED_PORT=port,
                                                     AUTOPAR_CLUSTER_TIMEOUT="15"))
    try:
        return ctx.run([PYTHON, str(script)], 40, ctx.env(**{**MS, "MS_WORKER_NUM": "3"}, MS_SCHED_PORT=port))
    finally:
        sched.kill()
        sched.communicate()


@case("environment", "hand-started rank table: the peer never comes (rank 0 must not wait the comm timeout)")
def rank_table_peer_missing(ctx):
    return ctx.python(INIT, limit=45, RANK_TABLE_FILE=_rank_table(ctx), RANK_ID="0", MASTER_PORT=ctx.free_port(),
                      AUTOPAR_CLUSTER_TIMEOUT="8")


@case("environment", "torchrun contract: the peer never comes")
def torchrun_peer_missing(ctx):
    return ctx.python(INIT, limit=45, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=ctx.free_port(), AUTOPAR_CLUSTER_TIMEOUT="8")


@case("environment", "AUTOPAR_HEARTBEAT_TIMEOUT=0 under the launcher")
def heartbeat_zero(ctx):
    return ctx.launch(2, ctx.script(INIT), AUTOPAR_HEARTBEAT_TIMEOUT="0")


@case("environment", "AUTOPAR_COMM_TIMEOUT=x under the launcher")
def comm_timeout_bad(ctx):
    run = ctx.launch(2, ctx.script(INIT), AUTOPAR_COMM_TIMEOUT="x")
    return Verdict(run)
