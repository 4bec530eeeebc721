/* Matches a repeat OTLP/JSON export against its template and reads its slots, in one pass.
 *
 * The C twin of collectors/_otlp_json_templates.py's numpy path (decode_matching and _parse),
 * which the tests hold it to bit for bit: a body is of the template's shape when its text
 * outside the slots is the template's fixed text, each slot being a maximal run of number
 * characters; each slot is read as its kind says, under the same rules as the numpy path:
 *
 *   uint:   1-19 digits, nothing else;
 *   int:    an optional '-' and digits, within int64;
 *   double: JSON's number grammar, at most 32 characters, finite, not the text "-0";
 *           parsed by strtod in the C locale (correctly rounded, as numpy's parser is).
 *
 * Called through ctypes, which releases the GIL: the receiver's decode threads run at once.
 */

#define _GNU_SOURCE
#include <locale.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { KIND_UINT = 0, KIND_INT = 1, KIND_DOUBLE = 2 };
enum { MAX_UINT_DIGITS = 19, MAX_WIDTH = 32 };

static int is_digit(uint8_t c) { return (uint8_t)(c - '0') < 10; }

/* Whether body[i] is part of a number run: a digit, '.', '-', an 'e' or 'E' after a digit,
 * a '+' after an 'e' or 'E' (as _number_chars says). */
static int number_char(const uint8_t *body, int64_t i) {
    uint8_t c = body[i];
    if (is_digit(c) || c == '.' || c == '-') return 1;
    if (i == 0) return 0;
    uint8_t before = body[i - 1];
    if (c == 'e' || c == 'E') return is_digit(before);
    if (c == '+') return before == 'e' || before == 'E';
    return 0;
}

static int read_uint(const uint8_t *s, int64_t n, uint64_t *out) {
    if (n > MAX_UINT_DIGITS) return 0;
    uint64_t v = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!is_digit(s[i])) return 0;
        v = v * 10 + (uint64_t)(s[i] - '0');
    }
    *out = v;
    return 1;
}

static int read_int(const uint8_t *s, int64_t n, double *out) {
    if (n > MAX_WIDTH) return 0;
    int negative = n > 0 && s[0] == '-';
    int64_t i = negative;
    if (i == n) return 0;
    uint64_t v = 0, limit = negative ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    for (; i < n; i++) {
        if (!is_digit(s[i])) return 0;
        uint64_t d = (uint64_t)(s[i] - '0');
        if (v > (limit - d) / 10) return 0; /* past int64 */
        v = v * 10 + d;
    }
    int64_t signed_v = negative ? (int64_t)(0 - v) : (int64_t)v;
    *out = (double)signed_v;
    return 1;
}

/* JSON's number grammar: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? */
static int json_number(const uint8_t *s, int64_t n) {
    int64_t i = 0;
    if (i < n && s[i] == '-') i++;
    if (i == n || !is_digit(s[i])) return 0;
    if (s[i] == '0') {
        i++;
    } else {
        while (i < n && is_digit(s[i])) i++;
    }
    if (i < n && s[i] == '.') {
        i++;
        if (i == n || !is_digit(s[i])) return 0;
        while (i < n && is_digit(s[i])) i++;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < n && (s[i] == '+' || s[i] == '-')) i++;
        if (i == n || !is_digit(s[i])) return 0;
        while (i < n && is_digit(s[i])) i++;
    }
    return i == n;
}

static locale_t c_locale(void) {
    static locale_t loc = (locale_t)0;
    if (loc == (locale_t)0) loc = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
    return loc;
}

static int read_double(const uint8_t *s, int64_t n, double *out) {
    if (n > MAX_WIDTH || !json_number(s, n)) return 0;
    if (n == 2 && s[0] == '-' && s[1] == '0') return 0; /* the fast path reads it as 0.0 */
    char text[MAX_WIDTH + 1];
    memcpy(text, s, (size_t)n);
    text[n] = '\0';
    double v = strtod_l(text, NULL, c_locale());
    if (isinf(v)) return 0;
    *out = v;
    return 1;
}

/* Returns 1 with words[i] (the uint slots' values, 0 elsewhere) and values[i] (every slot as
 * a double); 0 when the body is not of the template's shape, or a slot holds what the fast
 * path does not read so. ``fixed`` is the template's text outside its slots, in ``slots + 1``
 * segments of ``segment[i]`` bytes. */
__attribute__((visibility("default")))
int seedance_json_template_match(const uint8_t *body, int64_t n, const uint8_t *fixed,
                                 const int64_t *segment, int64_t slots, const uint8_t *kind,
                                 uint64_t *words, double *values) {
    if (c_locale() == (locale_t)0) return 0;
    int64_t at = 0;
    for (int64_t i = 0;; i++) {
        int64_t length = segment[i];
        if (length > n - at || memcmp(body + at, fixed, (size_t)length) != 0) return 0;
        at += length;
        fixed += length;
        if (i == slots) return at == n;
        int64_t start = at;
        while (at < n && number_char(body, at)) at++;
        if (at == start) return 0;
        const uint8_t *text = body + start;
        int64_t width = at - start;
        words[i] = 0;
        switch (kind[i]) {
        case KIND_UINT:
            if (!read_uint(text, width, &words[i])) return 0;
            values[i] = (double)words[i];
            break;
        case KIND_INT:
            if (!read_int(text, width, &values[i])) return 0;
            break;
        default:
            if (!read_double(text, width, &values[i])) return 0;
        }
    }
}
