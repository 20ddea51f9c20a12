/* specdec's binding to llama.cpp: a few calls with plain C arguments over llama.h.
 *
 * Python (specdec/gguf/binding.py) calls these through ctypes. Going through this file instead of
 * mirroring llama.h's structs in ctypes means the compiler, not a hand-written layout, lays out
 * llama_context_params and llama_batch: a llama.cpp upgrade that moves a field cannot corrupt a call.
 * Built with the library by specdec/gguf/build.py.
 */
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-cpu.h"
#include "llama.h"

typedef struct specdec_llama {
    struct llama_model *model;
    struct llama_context *ctx;
    struct llama_batch batch;
    struct ggml_threadpool *threadpool;
    uint32_t poll;
    int32_t n_batch;
    int32_t n_vocab;
} specdec_llama;

enum specdec_llama_fact {
    SPECDEC_N_VOCAB = 0,
    SPECDEC_N_CTX_TRAIN = 1,
    SPECDEC_N_EMBD = 2,
    SPECDEC_N_LAYER = 3,
    SPECDEC_EOS = 4,
    SPECDEC_EOT = 5,
    SPECDEC_N_CTX = 6,
    SPECDEC_N_CTX_SEQ = 7,
    SPECDEC_N_SEQ_MAX = 8,
    SPECDEC_N_BATCH = 9,
};

static enum ggml_log_level last_level = GGML_LOG_LEVEL_NONE;

/* llama.cpp narrates every load on stderr; keep its warnings and errors only. */
static void quiet_log(enum ggml_log_level level, const char *text, void *user_data) {
    (void)user_data;
    if (level != GGML_LOG_LEVEL_CONT) {
        last_level = level;
    }
    if (last_level >= GGML_LOG_LEVEL_WARN) {
        fputs(text, stderr);
    }
}

void specdec_llama_init(int verbose) {
    if (!verbose) {
        llama_log_set(quiet_log, NULL);
    }
    llama_backend_init();
}

const char *specdec_llama_system_info(void) { return llama_print_system_info(); }

/* The context's own threads (ggml's threadpool, not OpenMP: OpenMP binds a team of threads to each
 * thread that calls in, and two teams on a few cores slow each other). `poll` is ggml's polling level
 * between passes: 0 sleeps at once, leaving the cores to the processes beside it. */
static struct ggml_threadpool *new_threadpool(int32_t n_threads, uint32_t poll) {
    struct ggml_threadpool_params params = ggml_threadpool_params_default(n_threads);
    params.poll = poll;
    return ggml_threadpool_new(&params);
}

specdec_llama *specdec_llama_open(const char *path, uint32_t n_ctx, uint32_t n_seq_max, uint32_t n_batch,
                                  int32_t n_threads, int32_t kv_unified, int32_t flash_attn, uint32_t poll,
                                  char *error, size_t error_size) {
    struct llama_model_params model_params = llama_model_default_params();
    model_params.n_gpu_layers = 0;
    struct llama_model *model = llama_model_load_from_file(path, model_params);
    if (model == NULL) {
        snprintf(error, error_size, "llama.cpp cannot load %s", path);
        return NULL;
    }
    struct llama_context_params params = llama_context_default_params();
    params.n_ctx = n_ctx;
    params.n_batch = n_batch;
    params.n_ubatch = n_batch;
    params.n_seq_max = n_seq_max;
    params.n_threads = n_threads;
    params.n_threads_batch = n_threads;
    params.kv_unified = kv_unified != 0;
    params.flash_attn_type = (enum llama_flash_attn_type)flash_attn;
    params.no_perf = true;
    struct llama_context *ctx = llama_init_from_model(model, params);
    if (ctx == NULL) {
        snprintf(error, error_size, "llama.cpp cannot make a context of %u positions for %u sequences", n_ctx,
                 n_seq_max);
        llama_model_free(model);
        return NULL;
    }
    specdec_llama *handle = (specdec_llama *)calloc(1, sizeof(specdec_llama));
    if (handle == NULL) {
        snprintf(error, error_size, "out of memory");
        llama_free(ctx);
        llama_model_free(model);
        return NULL;
    }
    handle->model = model;
    handle->ctx = ctx;
    handle->poll = poll;
    handle->threadpool = new_threadpool(n_threads, poll);
    if (handle->threadpool == NULL) {
        snprintf(error, error_size, "ggml cannot start %d threads", n_threads);
        llama_free(ctx);
        llama_model_free(model);
        free(handle);
        return NULL;
    }
    llama_attach_threadpool(ctx, handle->threadpool, handle->threadpool);
    handle->n_batch = (int32_t)llama_n_batch(ctx);
    handle->n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    handle->batch = llama_batch_init(handle->n_batch, 0, 1);
    return handle;
}

void specdec_llama_close(specdec_llama *handle) {
    if (handle == NULL) {
        return;
    }
    llama_batch_free(handle->batch);
    llama_detach_threadpool(handle->ctx);
    llama_free(handle->ctx);
    ggml_threadpool_free(handle->threadpool);
    llama_model_free(handle->model);
    free(handle);
}

int64_t specdec_llama_fact(const specdec_llama *handle, int32_t fact) {
    const struct llama_vocab *vocab = llama_model_get_vocab(handle->model);
    switch (fact) {
    case SPECDEC_N_VOCAB: return handle->n_vocab;
    case SPECDEC_N_CTX_TRAIN: return llama_model_n_ctx_train(handle->model);
    case SPECDEC_N_EMBD: return llama_model_n_embd(handle->model);
    case SPECDEC_N_LAYER: return llama_model_n_layer(handle->model);
    case SPECDEC_EOS: return llama_vocab_eos(vocab);
    case SPECDEC_EOT: return llama_vocab_eot(vocab);
    case SPECDEC_N_CTX: return llama_n_ctx(handle->ctx);
    case SPECDEC_N_CTX_SEQ: return llama_n_ctx_seq(handle->ctx);
    case SPECDEC_N_SEQ_MAX: return llama_n_seq_max(handle->ctx);
    case SPECDEC_N_BATCH: return handle->n_batch;
    default: return -1;
    }
}

uint64_t specdec_llama_model_bytes(const specdec_llama *handle) { return llama_model_size(handle->model); }

int32_t specdec_llama_meta(const specdec_llama *handle, const char *key, char *value, size_t value_size) {
    return llama_model_meta_val_str(handle->model, key, value, value_size);
}

int32_t specdec_llama_set_threads(specdec_llama *handle, int32_t n_threads) {
    struct ggml_threadpool *threadpool = new_threadpool(n_threads, handle->poll);
    if (threadpool == NULL) {
        return 0;
    }
    llama_detach_threadpool(handle->ctx);
    ggml_threadpool_free(handle->threadpool);
    handle->threadpool = threadpool;
    llama_attach_threadpool(handle->ctx, threadpool, threadpool);
    llama_set_n_threads(handle->ctx, n_threads, n_threads);
    return 1;
}

/* One pass over n tokens (any mix of sequences), in chunks of at most n_batch tokens. Row i of
 * `logits_out` [outputs, n_vocab] holds the logits of the i-th token whose `want_logits` is set.
 * Returns 0, or llama_decode's code of the chunk that failed (earlier chunks stay in memory: the
 * caller removes the pass's positions). */
int32_t specdec_llama_decode(specdec_llama *handle, int32_t n, const int32_t *tokens, const int32_t *positions,
                             const int32_t *seq_ids, const int8_t *want_logits, float *logits_out) {
    int64_t row = 0;
    for (int32_t start = 0; start < n; start += handle->n_batch) {
        int32_t count = n - start < handle->n_batch ? n - start : handle->n_batch;
        struct llama_batch *batch = &handle->batch;
        int32_t outputs = 0;
        for (int32_t i = 0; i < count; i++) {
            batch->token[i] = tokens[start + i];
            batch->pos[i] = positions[start + i];
            batch->n_seq_id[i] = 1;
            batch->seq_id[i][0] = seq_ids[start + i];
            batch->logits[i] = want_logits[start + i] != 0;
            outputs += batch->logits[i];
        }
        batch->n_tokens = count;
        int32_t status = llama_decode(handle->ctx, *batch);
        if (status != 0) {
            return status;
        }
        if (outputs > 0) {
            const float *logits = llama_get_logits(handle->ctx);
            memcpy(logits_out + row * handle->n_vocab, logits, sizeof(float) * (size_t)outputs * handle->n_vocab);
            row += outputs;
        }
    }
    return 0;
}

int32_t specdec_llama_seq_rm(specdec_llama *handle, int32_t seq_id, int32_t p0, int32_t p1) {
    return llama_memory_seq_rm(llama_get_memory(handle->ctx), seq_id, p0, p1) ? 1 : 0;
}

int32_t specdec_llama_seq_pos_max(specdec_llama *handle, int32_t seq_id) {
    return llama_memory_seq_pos_max(llama_get_memory(handle->ctx), seq_id);
}
