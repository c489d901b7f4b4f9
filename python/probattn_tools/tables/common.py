"""What the experiments' table scripts share: mean ± std cells, differences with their standard
error (unpaired, and paired by seed), markdown tables. Imported by the other table scripts of
this folder."""

import math
import statistics


def mean_std(values):
    """(mean, sample std); the std of one value is 0."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def cell(values, digits=2):
    """'mean ± std (n=N)'; one value alone has no spread, so it is written 'value (n=1)'."""
    m, s = mean_std(values)
    if len(values) == 1:
        return f"{m:.{digits}f} (n=1)"
    return f"{m:.{digits}f} ± {s:.{digits}f} (n={len(values)})"


def diff_cell(a, b, digits=2):
    """mean(a) − mean(b) ± the standard error of the difference, sqrt(s_a²/n_a + s_b²/n_b);
    '–' when either side has fewer than two values (no variance, so no error to give)."""
    if len(a) < 2 or len(b) < 2:
        return "–"
    se = (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5
    return f"{statistics.mean(a) - statistics.mean(b):+.{digits}f} ± {se:.{digits}f} (n={len(a)} vs {len(b)})"


def fisher_exact(a, n_a, b, n_b):
    """Fisher's exact test of a/n_a against b/n_b (events out of trials), two-sided: the
    probability, with both margins fixed, of every split of the a + b events at most as likely as
    the one observed (the hypergeometric law: C(n_a, x) C(n_b, a + b − x) / C(n_a + n_b, a + b))."""
    events, total = a + b, n_a + n_b
    if not (0 <= a <= n_a and 0 <= b <= n_b):
        raise ValueError(f"events out of trials must lie in [0, trials], got {a}/{n_a} and {b}/{n_b}")

    def p(x):
        return math.comb(n_a, x) * math.comb(n_b, events - x) / math.comb(total, events)
    observed = p(a)
    splits = range(max(0, events - n_b), min(events, n_a) + 1)
    # A relative margin, as R's fisher.test takes, so that ties in exact arithmetic stay ties.
    return min(1.0, sum(p(x) for x in splits if p(x) <= observed * (1 + 1e-7)))


def paired_cell(a, b, digits=2):
    """Paired differences a[s] − b[s] over the seeds both have (dicts seed → value): their mean ±
    standard error, and on how many seeds a is above b; '–' under two shared seeds."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return "–"
    d = [a[s] - b[s] for s in seeds]
    se = statistics.stdev(d) / len(d) ** 0.5
    above = sum(x > 0 for x in d)
    return f"{statistics.mean(d):+.{digits}f} ± {se:.{digits}f} (above on {above} of {len(d)} seeds)"


def markdown(header, rows):
    """A markdown table: a header row, the separator, then one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)

