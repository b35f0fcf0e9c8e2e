#!/usr/bin/env bash
# A new language from start to finish, unattended: (from audio: prepare the features,) extend the
# tokenizer, re-tokenise the manifests, train until done (tools/cloud/train_until_done.sh), export for
# inference. The model family comes from BASE_DIR/config.yaml (`version: 2.5` is IndexTTS-2.5).
#
#   BASE_DIR=checkpoints TEXT_CORPUS=data/am_corpus.txt TARGET_VOCAB_SIZE=16000 \
#   AUDIO_LIST=data/am_list.jsonl WORK_DIR=work/amharic RUN_DIR=runs/amharic \
#   tools/cloud/new_language.sh --epochs 10 --amp              # IndexTTS2, from audio
#   BASE_DIR=checkpoints25 LANGUAGE=tr AUDIO_LIST=data/tr_list.jsonl WORK_DIR=work/turkish \
#   RUN_DIR=runs/turkish tools/cloud/new_language.sh --epochs 10 --amp bf16   # IndexTTS-2.5, from audio
#
# Arguments are passed to the trainer (hyperparameters, run length, --amp ...).
# Running it again after an interruption continues: the tokenizer is kept (WORK_DIR/bpe_N.model,
# never rebuilt once it exists), indextts-prepare continues where it stopped, the manifests are
# re-tokenised (unchanged files are not rewritten) and training resumes from RUN_DIR's newest checkpoint.
#
# IndexTTS2 (2.0): the tokenizer is extended with the new language's pieces; from audio, indextts-prepare
# tokenises with the extended one, so there is nothing to re-tokenise. IndexTTS-2.5: its byte-level tiktoken
# vocabulary is kept; the language's own rows train (the trainer's --new-language LANGUAGE).
#
# Settings (environment variables):
#   BASE_DIR            required: the official checkpoints folder of the base model, whose config.yaml is the
#                       full one: gpt.pth, config.yaml and bpe.model (IndexTTS2) or
#                       multilingual_zh_ja_yue_char_del.tiktoken (IndexTTS-2.5)
#   AUDIO_LIST          the utterance list (or folder of audio and transcripts) indextts-prepare reads; its
#                       manifests are then the training and validation manifests (WORK_DIR/prepared)
#   TRAIN_MANIFEST      training manifest (JSONL) whose text is in the new language: required without AUDIO_LIST
#   VAL_MANIFEST        optional: validation manifest (JSONL), without AUDIO_LIST
#   INDEXTTS_DIR        optional: a checkout of upstream IndexTTS for indextts-prepare (default: the installed
#                       indextts package); PREPARE_DEVICE optional: its --device (default auto)
#   TEXT_CORPUS         IndexTTS2: required: new-language text for the tokenizer (plain text, one sentence
#                       a line, or JSONL with a "text" field: the AUDIO_LIST when it is JSONL)
#   TARGET_VOCAB_SIZE   IndexTTS2: required: pieces of the extended tokenizer (more than bpe.model has, e.g. 16000)
#   WORK_DIR            required: where the extended tokenizer, the prepared features and manifests go
#   RUN_DIR             required: the training run directory (checkpoints, logs)
#   LANGUAGE            language tag of the manifests' lines (trainer's FILE::LANG, indextts-prepare's default
#                       language); required for IndexTTS-2.5 (its new language's code)
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
# failed (the training loop's: 2 bad data, 3 diverged, 128+N stopped by signal N, ...). indextts-prepare's
# status 3 (some lines skipped, each in WORK_DIR/prepared/skipped.txt) goes on to training.
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
need BASE_DIR "the base model's checkpoints folder (gpt.pth, config.yaml and its tokenizer)"
FAMILY=indextts2
if [[ -n ${BASE_DIR:-} && -f $BASE_DIR/config.yaml ]]; then
    FAMILY=$("$PYTHON" -c 'import sys, yaml; from trainers.families import family_for_config
print(family_for_config(yaml.safe_load(open(sys.argv[1], encoding="utf-8")) or {}).name)' \
        "$BASE_DIR/config.yaml" 2>/dev/null) || FAMILY=indextts2
fi
if [[ $FAMILY == indextts25 ]]; then
    BASE_TOKENIZER=multilingual_zh_ja_yue_char_del.tiktoken
    need LANGUAGE "the new language's code (IndexTTS-2.5 trains its rows, e.g. tr)"
    for var in TEXT_CORPUS TARGET_VOCAB_SIZE; do
        [[ -z ${!var:-} ]] || problems+=("$var is set, but IndexTTS-2.5 keeps its tokenizer (BASE_DIR/config.yaml says \
version 2.5): unset it")
    done
else
    BASE_TOKENIZER=bpe.model
    need TEXT_CORPUS "new-language text for the tokenizer (plain text or JSONL with a \"text\" field)"
    need TARGET_VOCAB_SIZE "size of the extended tokenizer, larger than the base bpe.model (e.g. 16000)"
fi
if [[ -n ${AUDIO_LIST:-} ]]; then
    [[ -e $AUDIO_LIST ]] || problems+=("AUDIO_LIST=$AUDIO_LIST: no such file or folder")
    for var in TRAIN_MANIFEST VAL_MANIFEST; do
        [[ -z ${!var:-} ]] || problems+=("$var is set with AUDIO_LIST: the manifests come from the audio; unset one")
    done
else
    need TRAIN_MANIFEST "training manifest (JSONL) in the new language (or AUDIO_LIST: audio and transcripts)"
fi
need WORK_DIR "folder for the extended tokenizer, the prepared features and the re-tokenised manifests"
need RUN_DIR "training run directory"
if [[ -n ${BASE_DIR:-} ]]; then
    for f in gpt.pth "$BASE_TOKENIZER" config.yaml; do
        [[ -f $BASE_DIR/$f ]] || problems+=("BASE_DIR=$BASE_DIR has no $f")
    done
fi
if [[ -n ${EXPORT_CONFIG:-} && ! -f $EXPORT_CONFIG ]]; then
    problems+=("EXPORT_CONFIG=$EXPORT_CONFIG: no such file")
fi
EXPORT_CONFIG=${EXPORT_CONFIG:-${BASE_DIR:+$BASE_DIR/config.yaml}}
if [[ -n $EXPORT_CONFIG && -f $EXPORT_CONFIG ]]; then  # hours of training must not end in a refused export
    if missing=$("$PYTHON" -c 'import sys, yaml; from trainers.families import family_for_config
from trainers.config.inference_keys import missing_inference_keys
data = yaml.safe_load(open(sys.argv[1], encoding="utf-8")) or {}
print("\n".join(missing_inference_keys(data, family_for_config(data).inference_keys)))' "$EXPORT_CONFIG" 2>&1); then
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
    best) [[ -n ${VAL_MANIFEST:-}${AUDIO_LIST:-} ]] || problems+=("EXPORT_WHICH=best needs VAL_MANIFEST (best.pth is kept by validation, by the trainer's --best-metric)") ;;
    latest) ;;
    *) problems+=("EXPORT_WHICH=$EXPORT_WHICH: expected best, latest or auto") ;;
esac
if ((${#problems[@]})); then
    echo "new_language.sh: cannot start:" >&2
    printf '  %s\n' "${problems[@]}" >&2
    echo "Set these environment variables (see the top of $0) and run it again; nothing was done." >&2
    exit 2
fi

TOKENIZER=$BASE_DIR/$BASE_TOKENIZER
[[ $FAMILY == indextts25 ]] || TOKENIZER=$WORK_DIR/bpe_$TARGET_VOCAB_SIZE.model
MANIFEST_DIR=$WORK_DIR/manifests_${TARGET_VOCAB_SIZE:-$FAMILY}
PREPARED=$WORK_DIR/prepared
EXPORT_DIR=${EXPORT_DIR:-$RUN_DIR/export}
SUFFIX=${LANGUAGE:+::$LANGUAGE}
STEPS=3
[[ $FAMILY == indextts25 ]] || STEPS=$((STEPS + 1))
[[ -z ${AUDIO_LIST:-} ]] || STEPS=$((STEPS + 1))
STEP=0
step() {  # step "what it does"
    STEP=$((STEP + 1))
    say "step $STEP/$STEPS: $*"
}

stop() {  # stop STATUS "what failed"
    say "FAILED (status $1): $2"
    exit "$1"
}

# --- tokenizer (IndexTTS2) ------------------------------------------------------------------
if [[ $FAMILY == indextts2 ]]; then
    if [[ -f $TOKENIZER ]]; then
        step "$TOKENIZER exists, kept (delete it to rebuild; a run trained with it only resumes with the same file)"
    else
        step "extending $BASE_DIR/bpe.model to $TARGET_VOCAB_SIZE pieces -> $TOKENIZER"
        mkdir -p -- "$WORK_DIR"
        "$PYTHON" "$REPO/tools/tokenizer/extend_bpe.py" --base-model "$BASE_DIR/bpe.model" \
            --manifests "$TEXT_CORPUS" --output-model "$TOKENIZER" --target-size "$TARGET_VOCAB_SIZE" ||
            stop $? "extending the tokenizer (its message is above)"
    fi
fi

# --- features from audio --------------------------------------------------------------------
if [[ -n ${AUDIO_LIST:-} ]]; then
    step "preparing $AUDIO_LIST with $BASE_DIR's models -> $PREPARED"
    prepare_flags=(--input "$AUDIO_LIST" --out "$PREPARED" --model-dir "$BASE_DIR" --tokenizer "$TOKENIZER")
    [[ -z ${INDEXTTS_DIR:-} ]] || prepare_flags+=(--indextts-dir "$INDEXTTS_DIR")
    [[ -z ${PREPARE_DEVICE:-} ]] || prepare_flags+=(--device "$PREPARE_DEVICE")
    [[ -z ${LANGUAGE:-} ]] || prepare_flags+=(--language "$LANGUAGE")
    status=0
    "$PYTHON" "$REPO/tools/prepare.py" "${prepare_flags[@]}" || status=$?
    case $status in
        0) ;;
        3) say "indextts-prepare skipped some lines (each in $PREPARED/skipped.txt); training on the rest" ;;
        *) stop "$status" "preparing the audio (its message is above)" ;;
    esac
    TRAIN_MANIFEST=$PREPARED/train_pairs.jsonl
    VAL_MANIFEST=
    [[ ! -s $PREPARED/val_pairs.jsonl ]] || VAL_MANIFEST=$PREPARED/val_pairs.jsonl
fi
manifests=("$TRAIN_MANIFEST")
[[ -n ${VAL_MANIFEST:-} ]] && manifests+=("$VAL_MANIFEST")
if [[ $EXPORT_WHICH == best && -z ${VAL_MANIFEST:-} ]]; then
    stop 2 "EXPORT_WHICH=best needs validation lines, and $PREPARED/val_pairs.jsonl has none"
fi

# --- text ids (IndexTTS2, manifests made before) ----------------------------------------------
if [[ $FAMILY == indextts2 && -z ${AUDIO_LIST:-} ]]; then
    step "re-tokenising ${manifests[*]} with $TOKENIZER -> $MANIFEST_DIR"
    "$PYTHON" "$REPO/tools/tokenizer/retokenize_manifest.py" --tokenizer "$TOKENIZER" --manifests "${manifests[@]}" \
        --output-dir "$MANIFEST_DIR" --config "$BASE_DIR/config.yaml" ||
        stop $? "re-tokenising the manifests (its message is above)"
    TRAIN_MANIFEST=$MANIFEST_DIR/${TRAIN_MANIFEST##*/}
    [[ -z ${VAL_MANIFEST:-} ]] || VAL_MANIFEST=$MANIFEST_DIR/${VAL_MANIFEST##*/}
fi

# --- training -------------------------------------------------------------------------------
train_flags=(--train-manifest "$TRAIN_MANIFEST$SUFFIX")
[[ -n ${VAL_MANIFEST:-} ]] && train_flags+=(--val-manifest "$VAL_MANIFEST$SUFFIX")
train_flags+=(--tokenizer "$TOKENIZER" --config "$BASE_DIR/config.yaml" --base-checkpoint "$BASE_DIR/gpt.pth"
    --output-dir "$RUN_DIR")
[[ $FAMILY == indextts2 ]] || train_flags+=(--new-language "$LANGUAGE")
train_flags+=("$@")
step "training until done (log: $RUN_DIR/train_until_done.log)"
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

# --- export ---------------------------------------------------------------------------------
if [[ $EXPORT_WHICH == auto ]]; then
    # best.pth (best validation by --best-metric) is kept by trainers that validate; older ones have none.
    if [[ -e $RUN_DIR/best.pth ]]; then EXPORT_WHICH=best; else EXPORT_WHICH=latest; fi
fi
if [[ -f $REPO/tools/export_checkpoint.py ]]; then
    step "exporting the $EXPORT_WHICH checkpoint of $RUN_DIR -> $EXPORT_DIR"
    "$PYTHON" "$REPO/tools/export_checkpoint.py" "$RUN_DIR" --which "$EXPORT_WHICH" --config "$EXPORT_CONFIG" \
        --out "$EXPORT_DIR" ||
        stop $? "exporting (its message is above)"
else
    step "export skipped: this checkout has no tools/export_checkpoint.py; the checkpoints are in $RUN_DIR"
fi
say "done"
