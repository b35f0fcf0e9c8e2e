#!/usr/bin/env bash
# Train until the run is finished, surviving crashes and kills: runs
#
#   python trainers/train_gpt_v2.py --resume auto YOUR FLAGS
#
# again and again until it exits 0. Every restart continues from the newest complete
# checkpoint, so the result is the one of an uninterrupted run.
#
#   tools/cloud/train_until_done.sh --output-dir runs/my_voice --train-manifest data/train.jsonl ...
#
# --output-dir is required (spelled out); do not pass --resume, the script adds it.
#
# Trainer status -> what the loop does:
#   0            finished (or nothing left to do): exit 0
#   2, 3         bad flags/data/run directory, or training diverged: final, exit with it
#   126, 127     PYTHON could not be run: final
#   129/130/143  the trainer stopped on a signal: no restart, exit with it
#   anything else (1, 4, 5, 137 = SIGKILL, 139 = crash, ...): restart after a pause. After
#                MAX_FAILURES attempts in a row that saved no new checkpoint the loop gives up
#                with the last status (an attempt that saved one resets the count).
# SIGTERM, SIGINT and SIGHUP sent to this script are passed to the trainer (once), which
# finishes its optimizer step, saves a checkpoint and exits 128+N; the script then exits with
# that status and does not restart. A second Ctrl-C is passed on too (the trainer then abandons
# the step, as when it runs alone); repeated SIGTERM/SIGHUP are not, so a shutdown that sends
# SIGHUP then SIGTERM still gets its checkpoint. The trainer runs in a process group of its own,
# so a terminal's Ctrl-C or hang-up reaches it only through this script; signal this script
# (or its process group), not the trainer as well.
#
# Environment:
#   PYTHON                          interpreter (default: python3)
#   TRAIN_UNTIL_DONE_BACKOFF        seconds to wait before a restart (default: 15)
#   TRAIN_UNTIL_DONE_MAX_FAILURES   failed attempts in a row before giving up (default: 5)
#
# Everything (these lines, with timestamps, and the trainer's output) is printed and appended
# to OUTPUT_DIR/train_until_done.log. OUTPUT_DIR/.train_until_done.attempt marks the start of
# the current attempt (to tell whether it saved a checkpoint).
set -uo pipefail

NAME=train_until_done
here=${BASH_SOURCE[0]%/*}
[[ $here == "${BASH_SOURCE[0]}" ]] && here=.
REPO=$(cd "$here/../.." && pwd -P) || exit 1
TRAINER=$REPO/trainers/train_gpt_v2.py
PYTHON=${PYTHON:-python3}
BACKOFF=${TRAIN_UNTIL_DONE_BACKOFF:-15}
MAX_FAILURES=${TRAIN_UNTIL_DONE_MAX_FAILURES:-5}

usage() {
    echo "usage: ${0##*/} --output-dir RUN_DIR [other train_gpt_v2.py flags]"
    echo "runs trainers/train_gpt_v2.py --resume auto with these flags until it finishes; see the top of $0"
}

fail_early() {  # before the log exists
    echo "$NAME: $1" >&2
    exit 2
}

OUTPUT_DIR=
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in
        -h | --help) usage; exit 0 ;;
        --output-dir) OUTPUT_DIR=${args[i + 1]:-} ;;
        --output-dir=*) OUTPUT_DIR=${args[i]#--output-dir=} ;;
        --resume | --resume=*)
            fail_early "do not pass --resume: every attempt adds --resume auto (continue the newest checkpoint of --output-dir, or start fresh)" ;;
    esac
done
[[ -n $OUTPUT_DIR ]] || { usage >&2; fail_early "--output-dir RUN_DIR is required (spelled out in full): the log and the checkpoints go there"; }
[[ $BACKOFF =~ ^[0-9]+([.][0-9]+)?$ ]] || fail_early "TRAIN_UNTIL_DONE_BACKOFF=$BACKOFF: expected seconds, e.g. 15 or 0.5"
[[ $MAX_FAILURES =~ ^[1-9][0-9]*$ ]] || fail_early "TRAIN_UNTIL_DONE_MAX_FAILURES=$MAX_FAILURES: expected a whole number >= 1"
[[ -f $TRAINER ]] || fail_early "no trainer at $TRAINER (the script must stay in tools/cloud/ of the repository)"
mkdir -p -- "$OUTPUT_DIR" || fail_early "cannot create --output-dir $OUTPUT_DIR"
LOG=$OUTPUT_DIR/train_until_done.log
MARK=$OUTPUT_DIR/.train_until_done.attempt

# From here on all output goes to the terminal and the log. tee ignores the stop signals (a
# Ctrl-C reaches the whole process group) so that it records the trainer's last lines.
exec 3>&1 4>&2
exec > >(trap '' INT TERM HUP PIPE; exec tee -a -- "$LOG") 2>&1
TEE_PID=$!

say() {
    local now
    printf -v now '%(%Y-%m-%d %H:%M:%S)T' -1
    printf '%s [%s] %s\n' "$now" "$NAME" "$*"
}

finish() {
    exec 1>&3 2>&4 3>&- 4>&-  # close the pipe so tee ends, then wait until it has written everything
    wait "$TEE_PID" 2>/dev/null
    exit "$1"
}

meaning() {
    case $1 in
        0) echo "finished" ;;
        1) echo "unexpected error (see the traceback above)" ;;
        2) echo "bad flags, data or run directory" ;;
        3) echo "training diverged" ;;
        4) echo "a checkpoint could not be written (disk full? permissions?)" ;;
        5) echo "out of memory" ;;
        126 | 127) echo "PYTHON=$PYTHON could not be run" ;;
        *)
            if (($1 > 128)); then
                local sig
                sig=$(kill -l "$(($1 - 128))" 2>/dev/null) || sig="signal $(($1 - 128))"
                case $sig in
                    KILL) echo "killed by SIGKILL (preemption, the kernel's out-of-memory killer, or kill -9)" ;;
                    INT | TERM | HUP) echo "stopped by SIG$sig" ;;
                    *) echo "died of SIG$sig" ;;
                esac
            else
                echo "unexpected status"
            fi
            ;;
    esac
}

CHILD=         # the running trainer's pid
STOP_SIGNAL=   # the first stop signal this script received
FORWARDED=0    # it was passed to the trainer
WOKEN=0        # a trapped signal interrupted `wait`

forward() {
    FORWARDED=1
    say "received SIG$STOP_SIGNAL: passing it to the trainer (pid $CHILD), which finishes its optimizer step, saves a checkpoint and exits; no restart after that"
    kill -s "$STOP_SIGNAL" "$CHILD" 2>/dev/null
}

# shellcheck disable=SC2329  # called by the traps below
on_signal() {
    local sig=$1
    WOKEN=1
    if [[ -z $STOP_SIGNAL ]]; then
        STOP_SIGNAL=$sig
        if [[ -n $CHILD ]]; then
            forward
        else
            say "received SIG$sig while no trainer runs: stopping; the last checkpoint stands"
        fi
    elif [[ -n $CHILD && $sig == INT ]]; then
        say "received SIGINT again: passing it on; the trainer abandons the step without saving, the last checkpoint stands"
        kill -s INT "$CHILD" 2>/dev/null
    elif [[ -n $CHILD ]]; then
        say "received SIG$sig again: not passed on (the trainer would abandon its step instead of saving); waiting for it. To abandon the step: kill -INT $CHILD"
    fi
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT
trap 'on_signal HUP' HUP

# Runs the trainer once; sets STATUS to its exit status.
run_trainer() {
    # Its own process group (set -m): a terminal's Ctrl-C or hang-up reaches the trainer only
    # through this script, so it gets each signal once. </dev/null: a background process group
    # must not read the terminal.
    set -m
    "$PYTHON" "$TRAINER" --resume auto "$@" </dev/null 3>&- 4>&- &
    CHILD=$!
    set +m
    # A signal handled before CHILD was set could not be passed on.
    [[ -n $STOP_SIGNAL && $FORWARDED == 0 ]] && forward
    local s
    while :; do
        WOKEN=0
        wait "$CHILD" 2>/dev/null  # 2>/dev/null: bash's own "Killed ..." notice; ours follows
        s=$?
        # A trap interrupted the wait: wait again for the real status (bash keeps it if the
        # trainer has ended meanwhile; 127 means it was already collected and STATUS holds it).
        if ((WOKEN)); then
            ((s == 127)) && break
            STATUS=$s
            continue
        fi
        STATUS=$s
        break
    done
    CHILD=
}

say "starting in $PWD: $PYTHON $TRAINER --resume auto $*"
say "log: $LOG; restart pause ${BACKOFF}s; gives up after $MAX_FAILURES failed attempts in a row"
attempt=0
failures=0
while [[ -z $STOP_SIGNAL ]]; do
    attempt=$((attempt + 1))
    : >"$MARK"
    say "attempt $attempt"
    STATUS=0
    run_trainer "$@"
    what=$(meaning "$STATUS")
    if [[ -n $STOP_SIGNAL ]]; then
        say "trainer exited with status $STATUS ($what) after SIG$STOP_SIGNAL; not restarting. Run this script again to continue"
        finish "$STATUS"
    fi
    case $STATUS in
        0)
            say "done: the trainer finished (attempt $attempt)"
            finish 0
            ;;
        2 | 3)
            say "FINAL: trainer exited with status $STATUS ($what); not restarting, a restart would fail the same way. Read the trainer's error above, fix it, and run this script again"
            finish "$STATUS"
            ;;
        126 | 127)
            say "FINAL: status $STATUS ($what); not restarting. Set PYTHON to the interpreter that has torch installed"
            finish "$STATUS"
            ;;
        129 | 130 | 143)
            say "trainer exited with status $STATUS ($what: a signal sent to the trainer itself, after saving); not restarting. Run this script again to continue"
            finish "$STATUS"
            ;;
    esac
    if [[ $OUTPUT_DIR/latest.pth -nt $MARK ]]; then
        failures=0  # it saved a checkpoint: progress, whatever ended it
        counted="it saved a checkpoint first"
    else
        failures=$((failures + 1))
        counted="failure $failures of $MAX_FAILURES in a row without a new checkpoint"
    fi
    if ((failures >= MAX_FAILURES)); then
        say "GIVING UP: trainer exited with status $STATUS ($what); $failures failed attempts in a row without a new checkpoint"
        finish "$STATUS"
    fi
    say "trainer exited with status $STATUS ($what); restarting in ${BACKOFF}s ($counted)"
    sleep "$BACKOFF" &
    wait $! 2>/dev/null || kill $! 2>/dev/null  # a signal ends the pause (and the loop)
done
finish $((128 + $(kill -l "$STOP_SIGNAL")))
