// tokenizer-goldens.js — golden token ids for tests/data/tokenizer, made by
// an independent implementation (@lenml/tokenizers, a fork of
// transformers.js) from the same tokenizer.json files kvdiff encodes with.
//
// usage: node scripts/tokenizer-goldens.js CACHE DATA
//   CACHE: what scripts/fetch-tokenizers filled (CACHE/npm, CACHE/<family>/)
//   DATA:  tests/data/tokenizer (sentences.jsonl in, <family>.golden.jsonl out)
// Line i of <family>.golden.jsonl holds the ids of line i of sentences.jsonl,
// with the tokenizer's special tokens added (BOS where the file says so).
"use strict";
const fs = require("fs");
const path = require("path");

const [cache, data] = process.argv.slice(2);
if (!cache || !data) {
    console.error("usage: node scripts/tokenizer-goldens.js CACHE DATA");
    process.exit(2);
}
const { TokenizerLoader } = require(path.resolve(cache, "npm/node_modules/@lenml/tokenizers"));
const sentences = fs.readFileSync(path.join(data, "sentences.jsonl"), "utf8")
    .split("\n").filter((l) => l.length > 0).map((l) => JSON.parse(l));

for (const family of ["gemma3", "qwen3", "llama3"]) {
    const dir = path.join(cache, family);
    const tok = TokenizerLoader.fromPreTrained({
        tokenizerJSON: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8")),
        tokenizerConfig: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8")),
    });
    const lines = sentences.map((s) => JSON.stringify(tok.encode(s)));
    fs.writeFileSync(path.join(data, family + ".golden.jsonl"), lines.join("\n") + "\n");
    console.log(`${family}: ${lines.length} sentences`);
}
