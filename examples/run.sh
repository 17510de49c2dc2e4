#!/bin/bash
# run data parallel training on CPU (the CPU tutorial's run.sh, for autopar)

echo "=============================================================================================================="
echo "Please run the script with dataset path, such as: "
echo "bash run.sh DATA_PATH"
echo "For example: bash run.sh /path/dataset"
echo "It is better to use the absolute path."
echo "=============================================================================================================="
set -e
DATA_PATH=$1
export DATA_PATH=${DATA_PATH}
SCRIPT_DIR=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}

export MS_WORKER_NUM=${WORKER_NUM:-8}
export MS_SCHED_HOST=127.0.0.1
export MS_SCHED_PORT=${SCHED_PORT:-8117}

# Launch 1 scheduler.
export MS_ROLE=MS_SCHED
$PYTHON "$SCRIPT_DIR/resnet50_distributed_training.py" >scheduler.txt 2>&1 &
SCHED_PID=$!
echo "scheduler start success!"

# Launch workers.
export MS_ROLE=MS_WORKER
for((i=0;i<${MS_WORKER_NUM};i++));
do
    $PYTHON "$SCRIPT_DIR/resnet50_distributed_training.py" >worker_$i.txt 2>&1 &
    echo "worker ${i} start success with pid ${!}"
done

# Unlike the tutorial, wait for the job: the scheduler exits with 0 only if every worker succeeded.
set +e
wait $SCHED_PID
status=$?
wait
echo "job finished with status $status"
if [ "$status" -ne 0 ]; then
    # why: the scheduler's last line names the rank that failed and its error (each rank's log: worker_<i>.txt)
    echo "scheduler.txt: $(grep -v '^\s*$' scheduler.txt | tail -n 1)"
fi
exit $status
