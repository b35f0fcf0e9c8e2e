#!/usr/bin/env bash
# A new language from start to finish, unattended: extend the tokenizer, re-tokenise the
# manifests, train until done (tools/cloud/train_until_done.sh), export for inference.
#
#   BASE_DIR=checkpoints TEXT_CORPUS=data/am_corpus.txt TARGET_VOCAB_SIZE=16000 \
#   TRAIN_MANIFEST=data/am_train.jsonl VAL_MANIFEST=data/am_val.jsonl \
#   WORK_DIR=work/amharic RUN_DIR=runs/amharic \
#   tools/cloud/new_language.sh --epochs 10 --amp
#
# Arguments are passed to the trainer (hyperparameters, run length, --amp ...).
# Running it again after an interruption continues: the tokenizer is kept (WORK_DIR/bpe_N.model,
# never rebuilt once it exists), the manifests are re-tokenised (unchanged files are not
# rewritten) and training resumes from RUN_DIR's newest checkpoint.
#
# Settings (environment variables):
#   BASE_DIR            required: folder with the base model's gpt.pth, bpe.model and config.yaml
#                       (the IndexTTS2 checkpoints folder, whose config.yaml is the full one)
#   TEXT_CORPUS         required: new-language text for the tokenizer (plain text, one sentence
#                       a line, or JSONL with a "text" field)
#   TRAIN_MANIFEST      required: training manifest (JSONL) whose text is in the new language
#   VAL_MANIFEST        optional: validation manifest (JSONL)
#   TARGET_VOCAB_SIZE   required: pieces of the extended tokenizer (more than bpe.model has, e.g. 16000)
#   WORK_DIR            required: where the extended tokenizer and the re-tokenised manifests go
#   RUN_DIR             required: the training run directory (checkpoints, logs)
#   LANGUAGE            optional: language tag of the manifests' lines (trainer's FILE::LANG)
#   EXPORT_DIR          optional: export folder (default RUN_DIR/export)
#   EXPORT_CONFIG       optional: the full IndexTTS2 config.yaml the export keeps (default
#                       BASE_DIR/config.yaml); checked before anything runs for every key inference
#                       reads (a trimmed config such as the repository's checkpoints/config.yaml is refused)
#   EXPORT_WHICH        optional: best, latest or auto (default auto: best if RUN_DIR has a best.pth,
#                       the checkpoint of the best validation by the trainer's --best-metric, else latest)
#   PYTHON              optional: interpreter (default python3)
#   TRAIN_UNTIL_DONE_BACKOFF, TRAIN_UNTIL_DONE_MAX_FAILURES: see train_until_done.sh
#
# Exit status: 0 done; 2 missing or wrong settings; otherwise the status of the step that
# failed (the training loop's: 2 bad data, 3 diverged, 128+N stopped by signal N, ...).
set -euo pipefail

here=${BASH_SOURCE[0]%/*}
[[ $here == "${BASH_SOURCE[0]}" ]] && here=.
HERE=$(cd "$here" && pwd -P)
REPO=$(cd "$HERE/../.." && pwd -P)
PYTHON=${PYTHON:-python3}

say() { printf '== new_language: %s\n' "$*"; }

# --- settings: report every problem at once, before anything runs --------------------------
problems=()
need() {  # need VAR "what it is"
    [[ -n ${!1:-} ]] || problems+=("$1 is not set: $2")
}
need BASE_DIR "folder with the base model's gpt.pth, bpe.model and config.yaml"
need TEXT_CORPUS "new-language text for the tokenizer (plain text or JSONL with a \"text\" field)"
need TRAIN_MANIFEST "training manifest (JSONL) in the new language"
need TARGET_VOCAB_SIZE "size of the extended tokenizer, larger than the base bpe.model (e.g. 16000)"
need WORK_DIR "folder for the extended tokenizer and the re-tokenised manifests"
need RUN_DIR "training run directory"
if [[ -n ${BASE_DIR:-} ]]; then
    for f in gpt.pth bpe.model config.yaml; do
        [[ -f $BASE_DIR/$f ]] || problems+=("BASE_DIR=$BASE_DIR has no $f")
    done
fi
if [[ -n ${EXPORT_CONFIG:-} && ! -f $EXPORT_CONFIG ]]; then
    problems+=("EXPORT_CONFIG=$EXPORT_CONFIG: no such file")
fi
EXPORT_CONFIG=${EXPORT_CONFIG:-${BASE_DIR:+$BASE_DIR/config.yaml}}
if [[ -n $EXPORT_CONFIG && -f $EXPORT_CONFIG ]]; then  # hours of training must not end in a refused export
    if missing=$("$PYTHON" "$REPO/trainers/config/inference_keys.py" "$EXPORT_CONFIG" 2>&1); then
        [[ -z $missing ]] || problems+=("$EXPORT_CONFIG lacks keys IndexTTS2 inference reads (${missing//$'\n'/, }): \
it is a trimmed config; the export needs the full config.yaml from your IndexTTS2 checkpoints folder \
(put it in BASE_DIR, or name it with EXPORT_CONFIG)")
    else
        problems+=("cannot check $EXPORT_CONFIG with $PYTHON: ${missing:-no message}")
    fi
fi
for var in TEXT_CORPUS TRAIN_MANIFEST VAL_MANIFEST; do
    if [[ -n ${!var:-} && ! -f ${!var} ]]; then
        problems+=("$var=${!var}: no such file")
    fi
done
if [[ -n ${TARGET_VOCAB_SIZE:-} && ! $TARGET_VOCAB_SIZE =~ ^[1-9][0-9]*$ ]]; then
    problems+=("TARGET_VOCAB_SIZE=$TARGET_VOCAB_SIZE: expected a whole number of pieces, e.g. 16000")
fi
case ${EXPORT_WHICH:=auto} in
    auto) ;;
    best) [[ -n ${VAL_MANIFEST:-} ]] || problems+=("EXPORT_WHICH=best needs VAL_MANIFEST (best.pth is kept by validation, by the trainer's --best-metric)") ;;
    latest) ;;
    *) problems+=("EXPORT_WHICH=$EXPORT_WHICH: expected best, latest or auto") ;;
esac
if ((${#problems[@]})); then
    echo "new_language.sh: cannot start:" >&2
    printf '  %s\n' "${problems[@]}" >&2
    echo "Set these environment variables (see the top of $0) and run it again; nothing was done." >&2
    exit 2
fi

TOKENIZER=$WORK_DIR/bpe_$TARGET_VOCAB_SIZE.model
MANIFEST_DIR=$WORK_DIR/manifests_$TARGET_VOCAB_SIZE
EXPORT_DIR=${EXPORT_DIR:-$RUN_DIR/export}
SUFFIX=${LANGUAGE:+::$LANGUAGE}
manifests=("$TRAIN_MANIFEST")
[[ -n ${VAL_MANIFEST:-} ]] && manifests+=("$VAL_MANIFEST")

stop() {  # stop STATUS "what failed"
    say "FAILED (status $1): $2"
    exit "$1"
}

# --- 1. tokenizer ---------------------------------------------------------------------------
if [[ -f $TOKENIZER ]]; then
    say "step 1/4: $TOKENIZER exists, kept (delete it to rebuild; a run trained with it only resumes with the same file)"
else
    say "step 1/4: extending $BASE_DIR/bpe.model to $TARGET_VOCAB_SIZE pieces -> $TOKENIZER"
    mkdir -p -- "$WORK_DIR"
    "$PYTHON" "$REPO/tools/tokenizer/extend_bpe.py" --base-model "$BASE_DIR/bpe.model" \
        --manifests "$TEXT_CORPUS" --output-model "$TOKENIZER" --target-size "$TARGET_VOCAB_SIZE" ||
        stop $? "extending the tokenizer (its message is above)"
fi

# --- 2. text ids ----------------------------------------------------------------------------
say "step 2/4: re-tokenising ${manifests[*]} with $TOKENIZER -> $MANIFEST_DIR"
"$PYTHON" "$REPO/tools/tokenizer/retokenize_manifest.py" --tokenizer "$TOKENIZER" --manifests "${manifests[@]}" \
    --output-dir "$MANIFEST_DIR" --config "$BASE_DIR/config.yaml" ||
    stop $? "re-tokenising the manifests (its message is above)"

# --- 3. training ----------------------------------------------------------------------------
train_flags=(--train-manifest "$MANIFEST_DIR/${TRAIN_MANIFEST##*/}$SUFFIX")
[[ -n ${VAL_MANIFEST:-} ]] && train_flags+=(--val-manifest "$MANIFEST_DIR/${VAL_MANIFEST##*/}$SUFFIX")
train_flags+=(--tokenizer "$TOKENIZER" --config "$BASE_DIR/config.yaml" --base-checkpoint "$BASE_DIR/gpt.pth"
    --output-dir "$RUN_DIR" "$@")
say "step 3/4: training until done (log: $RUN_DIR/train_until_done.log)"
# The loop runs in its own process group and gets stop signals from here only, once each (a
# terminal's Ctrl-C would otherwise reach it twice: directly and passed on).
LOOP=
EARLY=  # a signal that came before LOOP was set
pass_on() {
    WOKEN=1
    if [[ -n $LOOP ]]; then
        kill -s "$1" "$LOOP" 2>/dev/null || true
    else
        EARLY=$1
    fi
}
trap 'pass_on TERM' TERM
trap 'pass_on INT' INT
trap 'pass_on HUP' HUP
set -m
"$HERE/train_until_done.sh" "${train_flags[@]}" </dev/null &
LOOP=$!
set +m
[[ -z $EARLY ]] || kill -s "$EARLY" "$LOOP" 2>/dev/null || true
status=0
while :; do  # a signal interrupts `wait`: wait again until the loop has stopped
    WOKEN=0
    s=0
    wait "$LOOP" || s=$?
    if ((WOKEN)); then
        ((s == 127)) && break  # already collected: status holds it
        status=$s
        continue
    fi
    status=$s
    break
done
LOOP=
trap - TERM INT HUP
case $status in
    0) ;;
    129 | 130 | 143)
        say "stopped by a signal (status $status) after the trainer saved; run the same command again to continue"
        exit "$status"
        ;;
    *) stop "$status" "training (see $RUN_DIR/train_until_done.log)" ;;
esac

# --- 4. export ------------------------------------------------------------------------------
if [[ $EXPORT_WHICH == auto ]]; then
    # best.pth (best validation by --best-metric) is kept by trainers that validate; older ones have none.
    if [[ -e $RUN_DIR/best.pth ]]; then EXPORT_WHICH=best; else EXPORT_WHICH=latest; fi
fi
if [[ -f $REPO/tools/export_checkpoint.py ]]; then
    say "step 4/4: exporting the $EXPORT_WHICH checkpoint of $RUN_DIR -> $EXPORT_DIR"
    "$PYTHON" "$REPO/tools/export_checkpoint.py" "$RUN_DIR" --which "$EXPORT_WHICH" --config "$EXPORT_CONFIG" \
        --out "$EXPORT_DIR" ||
        stop $? "exporting (its message is above)"
else
    say "step 4/4: export skipped: this checkout has no tools/export_checkpoint.py; the checkpoints are in $RUN_DIR"
fi
say "done"
