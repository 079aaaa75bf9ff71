/* Kineto event scanner: the events of a Chrome-trace JSON text, sorted into what collect() keeps.

Role in the data flow: an optional compiled stage of ``megascope ingest kineto``, used by
megascope/ingest/kineto_events.py in place of msgspec's decode and the Python loop over events
(the two took ~65% of a rank file's CPU). It reads the text of the ``traceEvents`` array, one
whole event at a time, notes where the keys the mapping reads are, and appends to the same lists
and dicts, with the same values, that the Python loop builds; an event the mapping ignores costs
no Python object at all.

It refuses (``scan`` returns None) anything it is not sure to read exactly as the Python path does:
malformed JSON, keys with escapes, a relevant key twice, values of unexpected types, integers past
2^53 where times are compared, objects among the communication arguments. The caller then reads
the whole file again with the Python path, so a refusal changes nothing but the time taken.
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { S_OK = 0, S_MORE = 1, S_BAIL = 2 };
enum { T_NONE = 0, T_STR, T_INT, T_FLOAT, T_NULL, T_TRUE, T_FALSE, T_ARRAY, T_OBJECT };

#define MAX_DEPTH 64
#define EXACT_INT (1LL << 53)

typedef struct {
    const char *p;  /* strings: after the opening quote; others: first byte */
    Py_ssize_t n;   /* strings: raw length between the quotes; others: length of the value */
    int type;
    int esc;        /* strings: holds a backslash */
} Span;

/* Event keys and args keys the mapping reads. */
enum { K_PH, K_CAT, K_NAME, K_PID, K_TID, K_TS, K_DUR, K_COUNT };
enum {
    A_DEVICE, A_STREAM, A_CORRELATION, A_NAME,
    A_COLL, A_PG, A_NELEMS, A_DTYPE, A_SEQ, A_RANK, A_SRC, A_DST, /* COMM_ARGS, in their order */
    A_DIMS, A_ITYPE, A_CONCRETE,                                  /* HOST_COMM_ARGS */
    A_COUNT
};
static const char *ARG_KEYS[A_COUNT] = {
    "device", "stream", "correlation", "name",
    "Collective name", "Process Group Name", "In msg nelems", "dtype", "Seq", "Rank", "Src Rank", "Dst Rank",
    "Input Dims", "Input type", "Concrete Inputs",
};
static PyObject *ARG_STR[A_COUNT];

typedef struct {
    Span key[K_COUNT];
    Span arg[A_COUNT];
    int args; /* T_NONE (absent), T_NULL or T_OBJECT */
} Event;

/* ------------------------------------------------------------------ string cache */

typedef struct {
    uint64_t hash;
    char *raw;
    Py_ssize_t n;
    PyObject *str;
} Slot;

typedef struct {
    PyObject_HEAD
    PyObject *ops, *runtime, *device, *comm_calls, *steps, *flow_fwd, *flow_bwd, *thread_names, *comm_call;
    PyObject *pid, *first, *last;
    double first_v, last_v;
    Py_ssize_t count;
    int started; /* an event (or the end of the array) was read */
    Slot *slots;
    Py_ssize_t cap, used;
    char *scratch;
    Py_ssize_t scratch_cap;
} Collector;

static PyObject *S_RPC, *S_C10D, *S_ANNOT, *S_EMPTY, *S_CAT[7], *F_ZERO, *I_ZERO;
/* Host (0-1), runtime (2-5), kernel (6), copies (7-8). */
static const char *CAT_NAMES[9] = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver",
                                   "privateuse1_runtime", "privateuse1_driver", "kernel", "gpu_memcpy", "gpu_memset"};
static Py_ssize_t CAT_LEN[9];

/* A hash of the raw bytes of a string, 8 bytes at a time. */
static uint64_t hash_bytes(const char *p, Py_ssize_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDULL;
        h ^= h >> 32;
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, p, (size_t)n);
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ULL;
    return h ^ (h >> 29);
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int hex4(const char *p) {
    int v = 0;
    for (int i = 0; i < 4; i++) {
        int h = hexval(p[i]);
        if (h < 0) return -1;
        v = v * 16 + h;
    }
    return v;
}

static char *put_utf8(char *o, unsigned cp) {
    if (cp < 0x80) {
        *o++ = (char)cp;
    } else if (cp < 0x800) {
        *o++ = (char)(0xC0 | (cp >> 6));
        *o++ = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        *o++ = (char)(0xE0 | (cp >> 12));
        *o++ = (char)(0x80 | ((cp >> 6) & 0x3F));
        *o++ = (char)(0x80 | (cp & 0x3F));
    } else {
        *o++ = (char)(0xF0 | (cp >> 18));
        *o++ = (char)(0x80 | ((cp >> 12) & 0x3F));
        *o++ = (char)(0x80 | ((cp >> 6) & 0x3F));
        *o++ = (char)(0x80 | (cp & 0x3F));
    }
    return o;
}

/* The UTF-8 text of a string span (escapes resolved); NULL with *bail set if refused, or on no memory
   (with a Python error). The result lives in the collector's scratch buffer or in the input text. */
static const char *str_text(Collector *c, const Span *s, Py_ssize_t *len, int *bail) {
    *bail = 0;
    if (!s->esc) {
        *len = s->n;
        return s->p;
    }
    if (c->scratch_cap < s->n + 1) {
        char *grown = PyMem_Realloc(c->scratch, (size_t)s->n + 1);
        if (grown == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        c->scratch = grown;
        c->scratch_cap = s->n + 1;
    }
    const char *p = s->p, *end = s->p + s->n;
    char *o = c->scratch;
    while (p < end) {
        if (*p != '\\') {
            *o++ = *p++;
            continue;
        }
        p++;
        switch (*p++) {
        case '"': *o++ = '"'; break;
        case '\\': *o++ = '\\'; break;
        case '/': *o++ = '/'; break;
        case 'b': *o++ = '\b'; break;
        case 'f': *o++ = '\f'; break;
        case 'n': *o++ = '\n'; break;
        case 'r': *o++ = '\r'; break;
        case 't': *o++ = '\t'; break;
        case 'u': {
            int cp = hex4(p);
            p += 4;
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                int lo = (end - p >= 6 && p[0] == '\\' && p[1] == 'u') ? hex4(p + 2) : -1;
                if (lo < 0xDC00 || lo > 0xDFFF) {
                    *bail = 1; /* a lone surrogate: not text this scanner writes */
                    return NULL;
                }
                p += 6;
                o = put_utf8(o, 0x10000 + (((unsigned)cp - 0xD800) << 10) + ((unsigned)lo - 0xDC00));
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                *bail = 1;
                return NULL;
            } else {
                o = put_utf8(o, (unsigned)cp);
            }
            break;
        }
        default:
            *bail = 1;
            return NULL;
        }
    }
    *len = o - c->scratch;
    return c->scratch;
}

/* A new reference to the str of a string span, shared by equal spans of this collector. */
static PyObject *str_of(Collector *c, const Span *s, int *bail) {
    *bail = 0;
    uint64_t h = hash_bytes(s->p, s->n);
    if (c->used * 2 >= c->cap) {
        Py_ssize_t cap = c->cap ? c->cap * 2 : 1024;
        Slot *slots = PyMem_Calloc((size_t)cap, sizeof(Slot));
        if (slots == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        for (Py_ssize_t i = 0; i < c->cap; i++) {
            if (c->slots[i].raw == NULL) continue;
            Py_ssize_t j = (Py_ssize_t)(c->slots[i].hash & (uint64_t)(cap - 1));
            while (slots[j].raw != NULL) j = (j + 1) & (cap - 1);
            slots[j] = c->slots[i];
        }
        PyMem_Free(c->slots);
        c->slots = slots;
        c->cap = cap;
    }
    Py_ssize_t j = (Py_ssize_t)(h & (uint64_t)(c->cap - 1));
    while (c->slots[j].raw != NULL) {
        Slot *slot = &c->slots[j];
        if (slot->hash == h && slot->n == s->n && memcmp(slot->raw, s->p, (size_t)s->n) == 0) {
            Py_INCREF(slot->str);
            return slot->str;
        }
        j = (j + 1) & (c->cap - 1);
    }
    Py_ssize_t len;
    const char *text = str_text(c, s, &len, bail);
    if (text == NULL) return NULL;
    PyObject *str = PyUnicode_DecodeUTF8(text, len, "strict");
    if (str == NULL) {
        PyErr_Clear();
        *bail = 1;
        return NULL;
    }
    char *raw = PyMem_Malloc((size_t)s->n + 1);
    if (raw == NULL) {
        Py_DECREF(str);
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(raw, s->p, (size_t)s->n);
    c->slots[j].hash = h;
    c->slots[j].raw = raw;
    c->slots[j].n = s->n;
    c->slots[j].str = str;
    c->used++;
    Py_INCREF(str);
    return str;
}

/* ------------------------------------------------------------------ numbers */

static const double POW10[23] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
                                 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* The value of an integer span; 0 if it does not fit int64 (BAIL). */
static int int_value(const Span *s, long long *out) {
    const char *p = s->p, *end = s->p + s->n;
    int neg = 0;
    if (*p == '-') {
        neg = 1;
        p++;
    }
    unsigned long long v = 0;
    for (; p < end; p++) {
        unsigned d = (unsigned)(*p - '0');
        if (v > (ULLONG_MAX - d) / 10) return 0;
        v = v * 10 + d;
    }
    if (neg) {
        if (v > (unsigned long long)LLONG_MAX + 1) return 0;
        *out = (long long)(0 - v);
    } else {
        if (v > (unsigned long long)LLONG_MAX) return 0;
        *out = (long long)v;
    }
    return 1;
}

/* The double of a float span, as Python's float() reads it (correctly rounded); 0 if refused. */
static int float_value(const Span *s, double *out) {
    const char *p = s->p, *end = s->p + s->n;
    int neg = 0;
    if (*p == '-') {
        neg = 1;
        p++;
    }
    uint64_t m = 0;
    int digits = 0, exp10 = 0, fast = 1;
    for (; p < end && *p >= '0' && *p <= '9'; p++) {
        if (m || *p != '0') digits++;
        if (digits > 15) fast = 0;
        m = m * 10 + (uint64_t)(*p - '0');
    }
    if (p < end && *p == '.') {
        for (p++; p < end && *p >= '0' && *p <= '9'; p++) {
            if (m || *p != '0') digits++;
            if (digits > 15) fast = 0;
            m = m * 10 + (uint64_t)(*p - '0');
            exp10--;
        }
    }
    if (p < end) { /* exponent */
        p++;
        int eneg = 0, e = 0;
        if (*p == '+' || *p == '-') eneg = *p++ == '-';
        for (; p < end; p++) {
            if (e < 100000) e = e * 10 + (*p - '0');
        }
        exp10 += eneg ? -e : e;
    }
    if (fast && m < (1ULL << 53) && exp10 >= -22 && exp10 <= 22) {
        double v = (double)m;
        v = exp10 < 0 ? v / POW10[-exp10] : v * POW10[exp10];
        *out = neg ? -v : v;
        return 1;
    }
    char local[64];
    char *buf = s->n < (Py_ssize_t)sizeof(local) ? local : PyMem_Malloc((size_t)s->n + 1);
    if (buf == NULL) return 0;
    memcpy(buf, s->p, (size_t)s->n);
    buf[s->n] = 0;
    char *stop;
    double v = PyOS_string_to_double(buf, &stop, NULL);
    int ok = stop == buf + s->n && !(v == -1.0 && PyErr_Occurred()) && !Py_IS_INFINITY(v);
    PyErr_Clear();
    if (buf != local) PyMem_Free(buf);
    *out = v;
    return ok;
}

/* A number span as a Python object and its double (ints only up to 2^53, so that the double is
   exact); NULL with *bail set where refused. */
static PyObject *number(const Span *s, double *value, int *bail) {
    *bail = 1;
    if (s->type == T_INT) {
        long long v;
        if (!int_value(s, &v) || v > EXACT_INT || v < -EXACT_INT) return NULL;
        *bail = 0;
        *value = (double)v;
        return PyLong_FromLongLong(v);
    }
    double v;
    if (!float_value(s, &v)) return NULL;
    *bail = 0;
    *value = v;
    return PyFloat_FromDouble(v);
}

/* ------------------------------------------------------------------ JSON grammar */

typedef struct {
    const char *p, *end;
} Cursor;

/* JSON's whitespace: space, tab, newline, carriage return. */
static unsigned char SPACE[256];

static inline void skip_ws(Cursor *cur) {
    while (cur->p < cur->end && SPACE[(unsigned char)*cur->p]) cur->p++;
}

/* At the opening quote: the string's span; the cursor after the closing quote. */
/* Bytes that end a run of plain string text: the quote, the backslash, control characters. */
static unsigned char STOP[256];

static int scan_string(Cursor *cur, Span *s) {
    const char *p = cur->p + 1, *end = cur->end;
    int esc = 0;
    for (;;) {
        /* 4 bytes at a time while none ends the run */
        while (end - p >= 4 && !(STOP[(unsigned char)p[0]] | STOP[(unsigned char)p[1]] | STOP[(unsigned char)p[2]] |
                                 STOP[(unsigned char)p[3]]))
            p += 4;
        while (p < end && !STOP[(unsigned char)*p]) p++;
        if (p >= end) return S_MORE;
        if (*p == '"') break;
        if (*p != '\\') return S_BAIL; /* a raw control character */
        esc = 1;
        if (end - p < 2) return S_MORE;
        char e = p[1];
        if (e == 'u') {
            if (end - p < 6) return S_MORE;
            if (hex4(p + 2) < 0) return S_BAIL;
            p += 6;
        } else if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r' || e == 't') {
            p += 2;
        } else {
            return S_BAIL;
        }
    }
    if (s != NULL) {
        s->p = cur->p + 1;
        s->n = p - s->p;
        s->type = T_STR;
        s->esc = esc;
    }
    cur->p = p + 1;
    return S_OK;
}

#define DIGIT(ch) ((ch) >= '0' && (ch) <= '9')

static int scan_number(Cursor *cur, Span *s) {
    const char *p = cur->p, *end = cur->end;
    int type = T_INT;
    if (p < end && *p == '-') p++;
    if (p >= end) return S_MORE;
    if (*p == '0') {
        p++;
    } else if (DIGIT(*p)) {
        while (p < end && DIGIT(*p)) p++;
    } else {
        return S_BAIL;
    }
    if (p < end && *p == '.') {
        type = T_FLOAT;
        p++;
        if (p >= end) return S_MORE;
        if (!DIGIT(*p)) return S_BAIL;
        while (p < end && DIGIT(*p)) p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        type = T_FLOAT;
        p++;
        if (p < end && (*p == '+' || *p == '-')) p++;
        if (p >= end) return S_MORE;
        if (!DIGIT(*p)) return S_BAIL;
        while (p < end && DIGIT(*p)) p++;
    }
    if (p >= end) return S_MORE; /* a number is never the last thing of an event */
    s->p = cur->p;
    s->n = p - cur->p;
    s->type = type;
    s->esc = 0;
    cur->p = p;
    return S_OK;
}

static int scan_literal(Cursor *cur, const char *word, Py_ssize_t n) {
    Py_ssize_t have = cur->end - cur->p;
    if (memcmp(cur->p, word, (size_t)(have < n ? have : n)) != 0) return S_BAIL;
    if (have < n) return S_MORE;
    cur->p += n;
    return S_OK;
}

/* Any JSON value at the cursor (after whitespace); its span (type, and extent for containers). */
static int scan_value(Cursor *cur, Span *s, int depth) {
    const char *start = cur->p;
    int r;
    s->esc = 0;
    if (cur->p >= cur->end) return S_MORE;
    switch (*cur->p) {
    case '"':
        return scan_string(cur, s);
    case '{':
    case '[': {
        char close = *cur->p == '{' ? '}' : ']';
        int object = close == '}';
        if (depth >= MAX_DEPTH) return S_BAIL;
        cur->p++;
        skip_ws(cur);
        if (cur->p >= cur->end) return S_MORE;
        if (*cur->p != close) {
            for (;;) {
                Span inner;
                if (object) {
                    if (*cur->p != '"') return S_BAIL;
                    if ((r = scan_string(cur, NULL)) != S_OK) return r;
                    skip_ws(cur);
                    if (cur->p >= cur->end) return S_MORE;
                    if (*cur->p++ != ':') return S_BAIL;
                    skip_ws(cur);
                }
                if ((r = scan_value(cur, &inner, depth + 1)) != S_OK) return r;
                skip_ws(cur);
                if (cur->p >= cur->end) return S_MORE;
                if (*cur->p == close) break;
                if (*cur->p++ != ',') return S_BAIL;
                skip_ws(cur);
                if (cur->p >= cur->end) return S_MORE;
            }
        }
        cur->p++;
        s->p = start;
        s->n = cur->p - start;
        s->type = object ? T_OBJECT : T_ARRAY;
        return S_OK;
    }
    case 't':
        s->type = T_TRUE;
        r = scan_literal(cur, "true", 4);
        break;
    case 'f':
        s->type = T_FALSE;
        r = scan_literal(cur, "false", 5);
        break;
    case 'n':
        s->type = T_NULL;
        r = scan_literal(cur, "null", 4);
        break;
    default:
        return scan_number(cur, s);
    }
    s->p = start;
    s->n = cur->p - start;
    return r;
}

/* A set of keys to find, bucketed by length (at most 5 keys of one length). */
#define MAX_KEY 24
typedef struct {
    const char **names;
    int n;
    Py_ssize_t lens[A_COUNT];
    signed char by_len[MAX_KEY + 1][6];
} KeySet;

static const char *EVENT_KEYS[K_COUNT] = {"ph", "cat", "name", "pid", "tid", "ts", "dur"};
static KeySet EVENT_SET = {EVENT_KEYS, K_COUNT}, ARG_SET = {ARG_KEYS, A_COUNT};

static int keyset_init(KeySet *set) {
    memset(set->by_len, -1, sizeof set->by_len);
    for (int i = 0; i < set->n; i++) {
        Py_ssize_t n = (Py_ssize_t)strlen(set->names[i]);
        int j = 0;
        if (n > MAX_KEY) return -1;
        set->lens[i] = n;
        while (set->by_len[n][j] >= 0) j++;
        if (j >= 5) return -1;
        set->by_len[n][j] = (signed char)i;
    }
    return 0;
}

/* Which key of ``set`` the raw key is; -1 if none. */
static int which(const Span *key, const KeySet *set) {
    if (key->n > MAX_KEY) return -1;
    for (const signed char *c = set->by_len[key->n]; *c >= 0; c++) {
        const char *name = set->names[*c];
        Py_ssize_t j = 0;
        while (j < key->n && name[j] == key->p[j]) j++;
        if (j == key->n) return *c;
    }
    return -1;
}

/* One object's members: relevant keys' spans into ``spans`` (which/names/lens pick them); for
   events, ``ev`` also takes the args object. */
static int scan_members(Cursor *cur, Span *spans, const KeySet *set, Event *ev) {
    int r;
    cur->p++; /* '{' */
    skip_ws(cur);
    if (cur->p >= cur->end) return S_MORE;
    if (*cur->p == '}') {
        cur->p++;
        return S_OK;
    }
    for (;;) {
        Span key, value;
        if (*cur->p != '"') return S_BAIL;
        if ((r = scan_string(cur, &key)) != S_OK) return r;
        if (key.esc) return S_BAIL;
        skip_ws(cur);
        if (cur->p >= cur->end) return S_MORE;
        if (*cur->p++ != ':') return S_BAIL;
        skip_ws(cur);
        if (cur->p >= cur->end) return S_MORE;
        int k = which(&key, set);
        if (k >= 0) {
            if (spans[k].type != T_NONE) return S_BAIL; /* a key twice */
            if ((r = scan_value(cur, &spans[k], 1)) != S_OK) return r;
        } else if (ev != NULL && key.n == 4 && memcmp(key.p, "args", 4) == 0) {
            if (ev->args != T_NONE) return S_BAIL;
            if (*cur->p == '{') {
                ev->args = T_OBJECT;
                if ((r = scan_members(cur, ev->arg, &ARG_SET, NULL)) != S_OK) return r;
            } else {
                if ((r = scan_value(cur, &value, 1)) != S_OK) return r;
                if (value.type != T_NULL) return S_BAIL; /* msgspec refuses it: not this scanner's to read */
                ev->args = T_NULL;
            }
        } else if ((r = scan_value(cur, &value, 1)) != S_OK) {
            return r;
        }
        skip_ws(cur);
        if (cur->p >= cur->end) return S_MORE;
        if (*cur->p == '}') {
            cur->p++;
            return S_OK;
        }
        if (*cur->p++ != ',') return S_BAIL;
        skip_ws(cur);
        if (cur->p >= cur->end) return S_MORE;
    }
}

/* ------------------------------------------------------------------ Python values */

/* A value of a communication argument as msgspec builds it (no objects): NULL + *bail if refused. */
static PyObject *build(Collector *c, Cursor *cur, int *bail) {
    Span s;
    *bail = 1;
    skip_ws(cur);
    if (cur->p < cur->end && *cur->p == '[') {
        PyObject *list = PyList_New(0);
        if (list == NULL) {
            *bail = 0;
            return NULL;
        }
        cur->p++;
        skip_ws(cur);
        if (*cur->p == ']') {
            cur->p++;
            *bail = 0;
            return list;
        }
        for (;;) {
            PyObject *item = build(c, cur, bail);
            if (item == NULL || PyList_Append(list, item) < 0) {
                Py_XDECREF(item);
                Py_DECREF(list);
                return NULL;
            }
            Py_DECREF(item);
            skip_ws(cur);
            if (*cur->p == ']') {
                cur->p++;
                *bail = 0;
                return list;
            }
            cur->p++; /* ',' (the text was checked when it was scanned) */
        }
    }
    if (scan_value(cur, &s, 1) != S_OK) return NULL;
    double v;
    switch (s.type) {
    case T_STR:
        return str_of(c, &s, bail);
    case T_INT: {
        long long i;
        if (!int_value(&s, &i)) return NULL;
        *bail = 0;
        return PyLong_FromLongLong(i);
    }
    case T_FLOAT:
        if (!float_value(&s, &v)) return NULL;
        *bail = 0;
        return PyFloat_FromDouble(v);
    case T_NULL:
        *bail = 0;
        Py_RETURN_NONE;
    case T_TRUE:
        *bail = 0;
        Py_RETURN_TRUE;
    case T_FALSE:
        *bail = 0;
        Py_RETURN_FALSE;
    default:
        return NULL; /* an object */
    }
}

static PyObject *build_span(Collector *c, const Span *s, int *bail) {
    Cursor cur = {s->type == T_STR ? s->p - 1 : s->p, s->type == T_STR ? s->p + s->n + 1 : s->p + s->n};
    if (s->type == T_INT || s->type == T_FLOAT) cur.end = s->p + s->n + 1; /* the byte after a number ends it */
    return build(c, &cur, bail);
}

/* A key value the mapping hashes or shows (tid, stream, device, correlation): an int, a string or
   null; NULL + *bail for any other type. ``absent``: the value where the key is missing. */
static PyObject *simple(Collector *c, const Span *s, PyObject *absent, int *bail) {
    *bail = 0;
    switch (s->type) {
    case T_NONE:
        Py_INCREF(absent);
        return absent;
    case T_NULL:
        Py_RETURN_NONE;
    case T_STR:
        return str_of(c, s, bail);
    case T_INT: {
        long long v;
        if (int_value(s, &v)) return PyLong_FromLongLong(v);
        break;
    }
    default:
        break;
    }
    *bail = 1;
    return NULL;
}

/* The arguments named ``first``..``last`` that are present and not null, as a dict keyed by their names. */
static PyObject *args_dict(Collector *c, const Event *ev, int first, int last, int *bail) {
    *bail = 0;
    PyObject *out = PyDict_New();
    if (out == NULL || ev->args != T_OBJECT) return out;
    for (int k = first; k <= last; k++) {
        const Span *s = &ev->arg[k];
        if (s->type == T_NONE || s->type == T_NULL) continue;
        PyObject *value = build_span(c, s, bail);
        if (value == NULL || PyDict_SetItem(out, ARG_STR[k], value) < 0) {
            Py_XDECREF(value);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(value);
    }
    return out;
}

static int append_to(PyObject *dict, PyObject *key, PyObject *item) {
    PyObject *list = PyDict_GetItemWithError(dict, key);
    if (list == NULL) {
        if (PyErr_Occurred()) return -1;
        list = PyList_New(0);
        if (list == NULL) return -1;
        int r = PyDict_SetItem(dict, key, list);
        Py_DECREF(list);
        if (r < 0) return -1;
    }
    return PyList_Append(list, item);
}

static int starts(const char *text, Py_ssize_t n, const char *prefix) {
    Py_ssize_t k = (Py_ssize_t)strlen(prefix);
    return n >= k && memcmp(text, prefix, (size_t)k) == 0;
}

static int is_str(const Span *s, const char *word) {
    return s->type == T_STR && !s->esc && s->n == (Py_ssize_t)strlen(word) && memcmp(s->p, word, (size_t)s->n) == 0;
}

/* ------------------------------------------------------------------ one event */

#define TRY(expr) do { if ((expr) < 0) goto fail; } while (0)
#define NEED(obj) do { if ((obj) == NULL) goto refuse; } while (0)

/* What collect()'s loop does with one event. 0 done, -1 Python error, 1 refused. */
static int take(Collector *c, Event *ev) {
    int bail = 0;
    PyObject *ts = NULL, *dur = NULL, *end = NULL, *name = NULL, *tid = NULL, *item = NULL, *a = NULL, *b = NULL,
             *d = NULL, *args = NULL;
    const Span *ph = &ev->key[K_PH];
    c->count++;
    if (ph->type != T_STR) return 0;
    if (ph->esc) return 1;
    if (ph->n != 1) return 0;
    char kind = ph->p[0];
    const Span *cat = &ev->key[K_CAT];
    if (cat->type == T_STR && cat->esc) return 1;
    if (kind == 'X') {
        const Span *sts = &ev->key[K_TS], *sdur = &ev->key[K_DUR];
        if (sts->type != T_INT && sts->type != T_FLOAT) return 0;
        if (cat->type == T_ARRAY || cat->type == T_OBJECT) return 1; /* unhashable: the Python path fails */
        double tv, dv = 0.0, ev_end;
        NEED(ts = number(sts, &tv, &bail));
        if (sdur->type == T_INT || sdur->type == T_FLOAT) {
            NEED(dur = number(sdur, &dv, &bail));
        } else {
            Py_INCREF(F_ZERO);
            dur = F_ZERO;
        }
        if (PyLong_CheckExact(ts) && PyLong_CheckExact(dur)) { /* both exact below 2^53 */
            long long sum = (long long)tv + (long long)dv;
            if (sum > EXACT_INT || sum < -EXACT_INT) goto refuse;
            ev_end = (double)sum;
            end = PyLong_FromLongLong(sum);
        } else {
            ev_end = tv + dv;
            end = PyFloat_FromDouble(ev_end);
        }
        if (end == NULL) goto fail;
        if (c->first == NULL || tv < c->first_v) {
            Py_INCREF(ts);
            Py_XSETREF(c->first, ts);
            c->first_v = tv;
        }
        if (c->last == NULL || ev_end > c->last_v) {
            Py_INCREF(end);
            Py_XSETREF(c->last, end);
            c->last_v = ev_end;
        }
        int which_cat = -1;
        for (int i = 0; i < 9 && cat->type == T_STR; i++) {
            if (CAT_LEN[i] == cat->n && CAT_NAMES[i][0] == cat->p[0] && is_str(cat, CAT_NAMES[i])) {
                which_cat = i < 7 ? i : 7;
                break;
            }
        }
        if (which_cat < 0) goto done;
        const Span *sname = &ev->key[K_NAME];
        Py_ssize_t nlen = 0;
        const char *ntext = "";
        if (sname->type == T_STR) {
            NEED(name = str_of(c, sname, &bail));
            ntext = PyUnicode_AsUTF8AndSize(name, &nlen);
            if (ntext == NULL) goto fail;
        } else {
            Py_INCREF(S_EMPTY);
            name = S_EMPTY;
        }
        NEED(tid = simple(c, &ev->key[K_TID], I_ZERO, &bail));
        if (which_cat <= 1) { /* host op */
            if (starts(ntext, nlen, "ProfilerStep#")) {
                Py_ssize_t k = 13;
                if (k == nlen) goto done;
                for (Py_ssize_t i = k; i < nlen; i++) {
                    if ((unsigned char)ntext[i] >= 0x80) goto refuse; /* str.isdigit() takes other digits */
                    if (!DIGIT(ntext[i])) goto done;
                }
                if (nlen - k > 100) goto refuse;
                char digits[128];
                memcpy(digits, ntext + k, (size_t)(nlen - k));
                digits[nlen - k] = 0;
                a = PyLong_FromString(digits, NULL, 10);
                if (a == NULL) goto fail;
                item = PyTuple_Pack(3, a, ts, dur);
                if (item == NULL) goto fail;
                TRY(PyList_Append(c->steps, item));
                goto done;
            }
            const Span *spid = &ev->key[K_PID];
            if (spid->type == T_TRUE || spid->type == T_FALSE) goto refuse; /* isinstance(True, int) */
            if (c->pid == NULL && spid->type == T_INT) {
                long long v;
                if (!int_value(spid, &v)) goto refuse;
                c->pid = PyLong_FromLongLong(v);
                if (c->pid == NULL) goto fail;
            }
            PyObject *source = NULL;
            int first_arg = A_DIMS, last_arg = A_CONCRETE;
            if (nlen == 18 && memcmp(ntext, "record_param_comms", 18) == 0) {
                source = S_RPC;
                first_arg = A_COLL;
                last_arg = A_DST;
            } else if (starts(ntext, nlen, "c10d::")) {
                source = S_C10D;
            } else if (starts(ntext, nlen, "gloo:") || starts(ntext, nlen, "nccl:")) {
                source = S_ANNOT;
            }
            if (source != NULL) {
                NEED(args = args_dict(c, ev, first_arg, last_arg, &bail));
                item = PyObject_CallFunctionObjArgs(c->comm_call, source, tid, ts, end, name, args, NULL);
                if (item == NULL) goto fail;
                TRY(PyList_Append(c->comm_calls, item));
                goto done;
            }
            item = PyTuple_Pack(3, ts, end, name);
            if (item == NULL) goto fail;
            TRY(append_to(c->ops, tid, item));
        } else if (which_cat <= 5) { /* runtime */
            const Span *corr = &ev->arg[A_CORRELATION];
            if (ev->args != T_OBJECT || corr->type == T_NONE || corr->type == T_NULL) goto done;
            NEED(a = simple(c, corr, Py_None, &bail));
            item = PyTuple_Pack(2, tid, ts);
            if (item == NULL) goto fail;
            TRY(PyDict_SetItem(c->runtime, a, item));
        } else { /* kernel, memcpy, memset */
            PyObject *cat_str = which_cat == 6 ? S_CAT[6] : NULL;
            if (cat_str == NULL) {
                NEED(b = str_of(c, cat, &bail));
                cat_str = b;
            }
            if (ev->args != T_OBJECT) {
                item = PyTuple_Pack(8, name, cat_str, ts, dur, tid, Py_None, Py_None, Py_None);
            } else {
                NEED(a = simple(c, &ev->arg[A_STREAM], Py_None, &bail));
                NEED(d = simple(c, &ev->arg[A_DEVICE], Py_None, &bail));
                PyObject *corr = simple(c, &ev->arg[A_CORRELATION], Py_None, &bail);
                NEED(corr);
                if (which_cat == 6 && starts(ntext, nlen, "nccl")) {
                    args = args_dict(c, ev, A_COLL, A_DST, &bail);
                    if (args == NULL) {
                        Py_DECREF(corr);
                        goto refuse;
                    }
                } else {
                    Py_INCREF(Py_None);
                    args = Py_None;
                }
                item = PyTuple_Pack(8, name, cat_str, ts, dur, a == Py_None ? tid : a, d, corr, args);
                Py_DECREF(corr);
            }
            if (item == NULL) goto fail;
            TRY(PyList_Append(c->device, item));
        }
        goto done;
    }
    if (kind == 'M') {
        const Span *sname = &ev->key[K_NAME];
        if (!(sname->type == T_STR && !sname->esc && is_str(sname, "thread_name"))) {
            if (sname->type == T_STR && sname->esc) return 1;
            return 0;
        }
        NEED(tid = simple(c, &ev->key[K_TID], I_ZERO, &bail));
        const Span *value = &ev->arg[A_NAME];
        if (ev->args != T_OBJECT || value->type == T_NONE || value->type == T_NULL) {
            Py_INCREF(S_EMPTY);
            a = S_EMPTY;
        } else if (value->type == T_STR) {
            NEED(a = str_of(c, value, &bail));
        } else {
            goto refuse;
        }
        TRY(PyDict_SetItem(c->thread_names, tid, a));
        goto done;
    }
    if ((kind == 's' || kind == 'f') && is_str(cat, "fwdbwd")) {
        const Span *sts = &ev->key[K_TS];
        if (sts->type != T_INT && sts->type != T_FLOAT) return 0;
        double tv;
        NEED(ts = number(sts, &tv, &bail));
        NEED(tid = simple(c, &ev->key[K_TID], I_ZERO, &bail));
        TRY(append_to(kind == 's' ? c->flow_fwd : c->flow_bwd, tid, ts));
    }
done:
    Py_XDECREF(ts); Py_XDECREF(dur); Py_XDECREF(end); Py_XDECREF(name); Py_XDECREF(tid);
    Py_XDECREF(item); Py_XDECREF(a); Py_XDECREF(b); Py_XDECREF(d); Py_XDECREF(args);
    return 0;
refuse:
    Py_XDECREF(ts); Py_XDECREF(dur); Py_XDECREF(end); Py_XDECREF(name); Py_XDECREF(tid);
    Py_XDECREF(item); Py_XDECREF(a); Py_XDECREF(b); Py_XDECREF(d); Py_XDECREF(args);
    return PyErr_Occurred() ? -1 : 1;
fail:
    Py_XDECREF(ts); Py_XDECREF(dur); Py_XDECREF(end); Py_XDECREF(name); Py_XDECREF(tid);
    Py_XDECREF(item); Py_XDECREF(a); Py_XDECREF(b); Py_XDECREF(d); Py_XDECREF(args);
    return -1;
}

/* ------------------------------------------------------------------ the type */

static PyObject *Collector_scan(Collector *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "scan(text: str, pos: int)");
        return NULL;
    }
    PyObject *text = args[0];
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t nbytes;
    const char *data;
    int ascii = PyUnicode_IS_ASCII(text);
    if (ascii) {
        data = (const char *)PyUnicode_DATA(text);
        nbytes = PyUnicode_GET_LENGTH(text);
    } else {
        data = PyUnicode_AsUTF8AndSize(text, &nbytes);
        if (data == NULL) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
    }
    /* pos counts characters: its byte offset in the UTF-8 text */
    const char *p = data, *end = data + nbytes;
    if (ascii) {
        p = data + pos;
    } else {
        for (Py_ssize_t chars = 0; p < end && chars < pos; chars++) {
            p++;
            while (p < end && (*p & 0xC0) == 0x80) p++;
        }
    }
    const char *from = p;
    Cursor cur = {p, end};
    int closed = 0;
    for (;;) {
        const char *mark = cur.p;
        skip_ws(&cur);
        if (cur.p >= cur.end) {
            cur.p = mark;
            break;
        }
        if (*cur.p == ']') {
            cur.p++;
            closed = 1;
            break;
        }
        if (c->started) {
            if (*cur.p != ',') Py_RETURN_NONE;
            cur.p++;
            skip_ws(&cur);
            if (cur.p >= cur.end) {
                cur.p = mark;
                break;
            }
        }
        if (*cur.p != '{') Py_RETURN_NONE;
        Event ev; /* only the types say what was found: reset those (the whole struct is ~700 bytes) */
        for (int k = 0; k < K_COUNT; k++) ev.key[k].type = T_NONE;
        for (int k = 0; k < A_COUNT; k++) ev.arg[k].type = T_NONE;
        ev.args = T_NONE;
        int r = scan_members(&cur, ev.key, &EVENT_SET, &ev);
        if (r == S_MORE) {
            cur.p = mark;
            break;
        }
        if (r == S_BAIL) Py_RETURN_NONE;
        r = take(c, &ev);
        if (r < 0) return NULL;
        if (r > 0) Py_RETURN_NONE;
        c->started = 1;
    }
    Py_ssize_t consumed = cur.p - from;
    if (!ascii) {
        Py_ssize_t chars = 0;
        for (const char *q = from; q < cur.p; q++) chars += ((*q & 0xC0) != 0x80);
        consumed = chars;
    }
    return Py_BuildValue("(nO)", pos + consumed, closed ? Py_True : Py_False);
}

static int Collector_init(Collector *c, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"ops", "runtime", "device", "comm_calls", "steps", "flow_fwd", "flow_bwd",
                            "thread_names", "comm_call", NULL};
    PyObject *o[9];
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!O!O!O!O!O!O!O", names, &PyDict_Type, &o[0], &PyDict_Type,
                                     &o[1], &PyList_Type, &o[2], &PyList_Type, &o[3], &PyList_Type, &o[4],
                                     &PyDict_Type, &o[5], &PyDict_Type, &o[6], &PyDict_Type, &o[7], &o[8]))
        return -1;
    PyObject **slots[9] = {&c->ops, &c->runtime, &c->device, &c->comm_calls, &c->steps, &c->flow_fwd,
                           &c->flow_bwd, &c->thread_names, &c->comm_call};
    for (int i = 0; i < 9; i++) {
        Py_INCREF(o[i]);
        Py_XSETREF(*slots[i], o[i]);
    }
    return 0;
}

static void Collector_dealloc(Collector *c) {
    Py_XDECREF(c->ops); Py_XDECREF(c->runtime); Py_XDECREF(c->device); Py_XDECREF(c->comm_calls);
    Py_XDECREF(c->steps); Py_XDECREF(c->flow_fwd); Py_XDECREF(c->flow_bwd); Py_XDECREF(c->thread_names);
    Py_XDECREF(c->comm_call); Py_XDECREF(c->pid); Py_XDECREF(c->first); Py_XDECREF(c->last);
    for (Py_ssize_t i = 0; i < c->cap; i++) {
        if (c->slots[i].raw != NULL) {
            PyMem_Free(c->slots[i].raw);
            Py_DECREF(c->slots[i].str);
        }
    }
    PyMem_Free(c->slots);
    PyMem_Free(c->scratch);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyObject *get_or_none(PyObject *o) {
    if (o == NULL) Py_RETURN_NONE;
    Py_INCREF(o);
    return o;
}

static PyObject *Collector_pid(Collector *c, void *closure) { return get_or_none(c->pid); }
static PyObject *Collector_first(Collector *c, void *closure) { return get_or_none(c->first); }
static PyObject *Collector_last(Collector *c, void *closure) { return get_or_none(c->last); }
static PyObject *Collector_count(Collector *c, void *closure) { return PyLong_FromSsize_t(c->count); }

static PyGetSetDef Collector_getset[] = {
    {"pid", (getter)Collector_pid, NULL, "the first host op's integer pid (None: none seen)", NULL},
    {"first", (getter)Collector_first, NULL, "the earliest complete event's ts (None: none)", NULL},
    {"last", (getter)Collector_last, NULL, "the latest complete event's end (None: none)", NULL},
    {"count", (getter)Collector_count, NULL, "events read", NULL},
    {NULL},
};

static PyMethodDef Collector_methods[] = {
    {"scan", (PyCFunction)(void (*)(void))Collector_scan, METH_FASTCALL,
     "scan(text, pos) -> (pos, closed) or None: read the whole events of text from pos (a character index "
     "inside the traceEvents array); closed: the array's ']' was read. None: refused, read the file another way."},
    {NULL},
};

static PyTypeObject CollectorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "megascope.ingest._kscan.Collector",
    .tp_basicsize = sizeof(Collector),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Collector(ops, runtime, device, comm_calls, steps, flow_fwd, flow_bwd, thread_names, comm_call): "
              "the Kineto events of a text, appended to these containers as kineto_events.collect does.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Collector_init,
    .tp_dealloc = (destructor)Collector_dealloc,
    .tp_methods = Collector_methods,
    .tp_getset = Collector_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kscan", "Kineto event scanner (see _kscan.c).", -1, NULL};

PyMODINIT_FUNC PyInit__kscan(void) {
    for (int i = 0; i < A_COUNT; i++) {
        ARG_STR[i] = PyUnicode_InternFromString(ARG_KEYS[i]);
        if (ARG_STR[i] == NULL) return NULL;
    }
    if (keyset_init(&EVENT_SET) < 0 || keyset_init(&ARG_SET) < 0) {
        PyErr_SetString(PyExc_SystemError, "_kscan: a key set does not fit its table");
        return NULL;
    }
    SPACE[' '] = SPACE['\t'] = SPACE['\n'] = SPACE['\r'] = 1;
    for (int i = 0; i < 0x20; i++) STOP[i] = 1;
    STOP['"'] = STOP['\\'] = 1;
    for (int i = 0; i < 9; i++) CAT_LEN[i] = (Py_ssize_t)strlen(CAT_NAMES[i]);
    for (int i = 0; i < 7; i++) {
        S_CAT[i] = PyUnicode_InternFromString(CAT_NAMES[i]);
        if (S_CAT[i] == NULL) return NULL;
    }
    S_RPC = PyUnicode_InternFromString("rpc");
    S_C10D = PyUnicode_InternFromString("c10d");
    S_ANNOT = PyUnicode_InternFromString("annot");
    S_EMPTY = PyUnicode_InternFromString("");
    F_ZERO = PyFloat_FromDouble(0.0);
    I_ZERO = PyLong_FromLong(0);
    if (!S_RPC || !S_C10D || !S_ANNOT || !S_EMPTY || !F_ZERO || !I_ZERO) return NULL;
    if (PyType_Ready(&CollectorType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&CollectorType);
    if (PyModule_AddObject(m, "Collector", (PyObject *)&CollectorType) < 0) {
        Py_DECREF(&CollectorType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
