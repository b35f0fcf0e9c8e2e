"""The tools users run around training (export, inspect, plots, pack, tokenizer): their code, called by
the console scripts (indextts-export, ...) and by the scripts in tools/."""
