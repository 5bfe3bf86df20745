//! The CUDA C source of every eager kernel but matmul (cuBLAS), compiled once per device with
//! NVRTC. One thread per output element or per row (and one thread in all for the scalar loss),
//! so every kernel is a plain loop body: simple and deterministic rather than fast — the eager
//! layer exists to drive the allocator.

/// Names of the kernels in [`SOURCE`], loaded after compilation.
pub const NAMES: [&str; 20] = [
    "fill",
    "binary",
    "scale",
    "unary",
    "unary_backward",
    "transpose",
    "softmax",
    "softmax_backward",
    "layer_norm",
    "layer_norm_backward_dx",
    "layer_norm_backward_params",
    "sum_last",
    "broadcast_last",
    "sum_rows",
    "embedding",
    "embedding_backward",
    "cross_entropy",
    "cross_entropy_backward",
    "sgd",
    "adamw",
];

/// The kernels. `op` codes: binary 0 add, 1 mul; unary 0 relu, 1 gelu. Ids and classes are
/// floats; an out-of-range one writes NaN (a kernel cannot fail more loudly without killing the
/// context).
pub const SOURCE: &str = r#"
#define GELU_C 0.7978845608f
#define GELU_A 0.044715f
#define IDX (blockIdx.x * blockDim.x + threadIdx.x)

__device__ float gelu_f(float x) {
    return 0.5f * x * (1.0f + tanhf(GELU_C * (x + GELU_A * x * x * x)));
}

__device__ float gelu_grad(float x) {
    float t = tanhf(GELU_C * (x + GELU_A * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * GELU_C * (1.0f + 3.0f * GELU_A * x * x);
}

__device__ void row_stats(const float *x, unsigned int cols, float eps, float *mean, float *rstd) {
    float s = 0.0f;
    for (unsigned int c = 0; c < cols; c++) s += x[c];
    float m = s / (float)cols;
    float v = 0.0f;
    for (unsigned int c = 0; c < cols; c++) v += (x[c] - m) * (x[c] - m);
    *mean = m;
    *rstd = rsqrtf(v / (float)cols + eps);
}

extern "C" __global__ void fill(float *out, unsigned int n, float value) {
    unsigned int i = IDX;
    if (i < n) out[i] = value;
}

extern "C" __global__ void binary(int op, const float *a, const float *b, float *out,
                                  unsigned int n, unsigned int b_len) {
    unsigned int i = IDX;
    if (i < n) {
        float y = b[i % b_len];
        out[i] = op == 0 ? a[i] + y : a[i] * y;
    }
}

extern "C" __global__ void scale(const float *x, float *out, unsigned int n, float alpha) {
    unsigned int i = IDX;
    if (i < n) out[i] = alpha * x[i];
}

extern "C" __global__ void unary(int op, const float *x, float *out, unsigned int n) {
    unsigned int i = IDX;
    if (i < n) out[i] = op == 0 ? fmaxf(x[i], 0.0f) : gelu_f(x[i]);
}

extern "C" __global__ void unary_backward(int op, const float *x, const float *dy, float *out,
                                          unsigned int n) {
    unsigned int i = IDX;
    if (i < n) out[i] = op == 0 ? (x[i] > 0.0f ? dy[i] : 0.0f) : gelu_grad(x[i]) * dy[i];
}

extern "C" __global__ void transpose(const float *x, float *out, unsigned int batch,
                                     unsigned int rows, unsigned int cols) {
    unsigned int i = IDX;
    unsigned int per = rows * cols;
    if (i < batch * per) {
        unsigned int p = i / per, r = (i / cols) % rows, c = i % cols;
        out[p * per + c * rows + r] = x[i];
    }
}

extern "C" __global__ void softmax(const float *x, float *out, unsigned int rows,
                                   unsigned int cols) {
    unsigned int r = IDX;
    if (r >= rows) return;
    const float *xr = x + (size_t)r * cols;
    float *yr = out + (size_t)r * cols;
    float m = -INFINITY;
    for (unsigned int c = 0; c < cols; c++) m = fmaxf(m, xr[c]);
    float s = 0.0f;
    for (unsigned int c = 0; c < cols; c++) { yr[c] = expf(xr[c] - m); s += yr[c]; }
    for (unsigned int c = 0; c < cols; c++) yr[c] /= s;
}

extern "C" __global__ void softmax_backward(const float *y, const float *dy, float *out,
                                            unsigned int rows, unsigned int cols) {
    unsigned int r = IDX;
    if (r >= rows) return;
    size_t o = (size_t)r * cols;
    float dot = 0.0f;
    for (unsigned int c = 0; c < cols; c++) dot += y[o + c] * dy[o + c];
    for (unsigned int c = 0; c < cols; c++) out[o + c] = y[o + c] * (dy[o + c] - dot);
}

extern "C" __global__ void layer_norm(const float *x, const float *g, const float *b, float *out,
                                      unsigned int rows, unsigned int cols, float eps) {
    unsigned int r = IDX;
    if (r >= rows) return;
    size_t o = (size_t)r * cols;
    float mean, rstd;
    row_stats(x + o, cols, eps, &mean, &rstd);
    for (unsigned int c = 0; c < cols; c++) out[o + c] = (x[o + c] - mean) * rstd * g[c] + b[c];
}

extern "C" __global__ void layer_norm_backward_dx(const float *x, const float *g, const float *dy,
                                                  float *dx, unsigned int rows, unsigned int cols,
                                                  float eps) {
    unsigned int r = IDX;
    if (r >= rows) return;
    size_t o = (size_t)r * cols;
    float mean, rstd;
    row_stats(x + o, cols, eps, &mean, &rstd);
    float s1 = 0.0f, s2 = 0.0f;
    for (unsigned int c = 0; c < cols; c++) {
        float gy = dy[o + c] * g[c];
        s1 += gy;
        s2 += gy * (x[o + c] - mean) * rstd;
    }
    float n = (float)cols;
    for (unsigned int c = 0; c < cols; c++) {
        float xhat = (x[o + c] - mean) * rstd;
        dx[o + c] = rstd * (dy[o + c] * g[c] - s1 / n - xhat * s2 / n);
    }
}

extern "C" __global__ void layer_norm_backward_params(const float *x, const float *dy, float *dg,
                                                      float *db, unsigned int rows,
                                                      unsigned int cols, float eps) {
    unsigned int c = IDX;
    if (c >= cols) return;
    float sg = 0.0f, sb = 0.0f;
    for (unsigned int r = 0; r < rows; r++) {
        size_t o = (size_t)r * cols;
        float mean, rstd;
        row_stats(x + o, cols, eps, &mean, &rstd);
        sg += dy[o + c] * (x[o + c] - mean) * rstd;
        sb += dy[o + c];
    }
    dg[c] = sg;
    db[c] = sb;
}

extern "C" __global__ void sum_last(const float *x, float *out, unsigned int rows,
                                    unsigned int cols, float scale) {
    unsigned int r = IDX;
    if (r >= rows) return;
    float s = 0.0f;
    for (unsigned int c = 0; c < cols; c++) s += x[(size_t)r * cols + c];
    out[r] = scale * s;
}

extern "C" __global__ void broadcast_last(const float *dy, float *out, unsigned int rows,
                                          unsigned int cols, float scale) {
    unsigned int i = IDX;
    if (i < rows * cols) out[i] = scale * dy[i / cols];
}

extern "C" __global__ void sum_rows(const float *x, float *out, unsigned int rows,
                                    unsigned int cols) {
    unsigned int c = IDX;
    if (c >= cols) return;
    float s = 0.0f;
    for (unsigned int r = 0; r < rows; r++) s += x[(size_t)r * cols + c];
    out[c] = s;
}

extern "C" __global__ void embedding(const float *table, const float *ids, float *out,
                                     unsigned int n_ids, unsigned int vocab, unsigned int dim) {
    unsigned int i = IDX;
    if (i >= n_ids * dim) return;
    unsigned int row = i / dim, c = i % dim;
    float id = ids[row];
    out[i] = (id >= 0.0f && id < (float)vocab) ? table[(size_t)id * dim + c] : NAN;
}

extern "C" __global__ void embedding_backward(const float *ids, const float *dy, float *out,
                                              unsigned int n_ids, unsigned int vocab,
                                              unsigned int dim) {
    unsigned int i = IDX;
    if (i >= vocab * dim) return;
    unsigned int v = i / dim, c = i % dim;
    float s = 0.0f;
    for (unsigned int r = 0; r < n_ids; r++) {
        float id = ids[r];
        // An id out of range (negative, NaN, past the vocabulary) makes the gradient NaN, as
        // the host kernel's (a negative float converted to unsigned is undefined in C).
        if (!(id >= 0.0f && id < (float)vocab)) { s = NAN; break; }
        if ((unsigned int)id == v) s += dy[(size_t)r * dim + c];
    }
    out[i] = s;
}

extern "C" __global__ void cross_entropy(const float *logits, const float *targets, float *out,
                                         unsigned int rows, unsigned int cols) {
    if (IDX != 0) return;
    float total = 0.0f;
    for (unsigned int r = 0; r < rows; r++) {
        const float *l = logits + (size_t)r * cols;
        float t = targets[r];
        if (!(t >= 0.0f && t < (float)cols)) { out[0] = NAN; return; }
        float m = -INFINITY;
        for (unsigned int c = 0; c < cols; c++) m = fmaxf(m, l[c]);
        float s = 0.0f;
        for (unsigned int c = 0; c < cols; c++) s += expf(l[c] - m);
        total += m + logf(s) - l[(unsigned int)t];
    }
    out[0] = total / (float)rows;
}

extern "C" __global__ void cross_entropy_backward(const float *logits, const float *targets,
                                                  float *out, unsigned int rows,
                                                  unsigned int cols, float scale) {
    unsigned int r = IDX;
    if (r >= rows) return;
    size_t o = (size_t)r * cols;
    float t = targets[r];
    float m = -INFINITY;
    for (unsigned int c = 0; c < cols; c++) m = fmaxf(m, logits[o + c]);
    float s = 0.0f;
    for (unsigned int c = 0; c < cols; c++) s += expf(logits[o + c] - m);
    for (unsigned int c = 0; c < cols; c++) {
        float p = expf(logits[o + c] - m) / s;
        if (!(t >= 0.0f && t < (float)cols)) p = NAN;
        else if (c == (unsigned int)t) p -= 1.0f;
        out[o + c] = scale * p;
    }
}

extern "C" __global__ void sgd(float *p, const float *g, unsigned int n, float lr, float wd) {
    unsigned int i = IDX;
    if (i < n) p[i] -= lr * (g[i] + wd * p[i]);
}

extern "C" __global__ void adamw(float *p, const float *g, float *m, float *v, unsigned int n,
                                 float lr, float b1, float b2, float eps, float wd, float bc1,
                                 float bc2) {
    unsigned int i = IDX;
    if (i >= n) return;
    m[i] = b1 * m[i] + (1.0f - b1) * g[i];
    v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
    float update = (m[i] / bc1) / (sqrtf(v[i] / bc2) + eps);
    p[i] -= lr * (update + wd * p[i]);
}
"#;
