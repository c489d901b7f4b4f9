//! `probattn bench`'s tables (bench.md): the ratios of time and memory against PyTorch, the
//! layer's throughput, and the SVGD hook's line.

use super::{variants, Measurement, SvgdTiming, FUSED, MEMORY_EFFICIENT};

pub(super) const MIB: f64 = 1024.0 * 1024.0;

/// The markdown table: per sequence length and variant, ours, PyTorch's, and the ratios, of time
/// and of peak memory; the SVGD hook's line under it where it was timed.
pub fn ratio_table(m: &[Measurement], svgd: Option<&SvgdTiming>) -> String {
    let row = |v: &str, imp: &str, s: i64| m.iter().find(|x| x.variant == v && x.implementation == imp && x.seq_len == s);
    let find = |v: &str, imp: &str, s: i64| row(v, imp, s).map(|x| x.fwd_bwd_ms);
    let mem = |v: &str, imp: &str, s: i64| row(v, imp, s).and_then(|x| x.peak_mem_bytes).map(|b| b as f64 / MIB);
    let mut seqs: Vec<i64> = m.iter().map(|x| x.seq_len).collect();
    seqs.sort();
    seqs.dedup();
    let fmt = |x: Option<f64>| x.map_or("–".to_string(), |v| format!("{v:.2}"));
    let fmt1 = |x: Option<f64>| x.map_or("–".to_string(), |v| format!("{v:.1}"));
    // A row setting ours against another measurement: times, their ratio, peaks, their ratio.
    let versus = |s: i64, what: &str, other: &str, (a, b): (Option<f64>, Option<f64>), (a_mem, b_mem): (Option<f64>, Option<f64>)| {
        format!(
            "| {s} | {what} | {} | {} ({other}) | | {} | {} | {} ({other}) | {} |\n",
            fmt(a),
            fmt(b),
            fmt(a.zip(b).map(|(x, y)| x / y)),
            fmt1(a_mem),
            fmt1(b_mem),
            fmt(a_mem.zip(b_mem).map(|(x, y)| x / y))
        )
    };
    let mut t = String::from(
        "| S | variant | probattn ms | PyTorch ms | variant / softmax (probattn) | probattn / PyTorch | probattn peak MiB | PyTorch peak MiB | memory probattn / PyTorch |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    // The variants measured at all (--variants may leave some out), in the usual order.
    let measured: Vec<&str> = variants().into_iter().filter(|v| m.iter().any(|x| x.variant == *v)).collect();
    let eager_rows = m.iter().any(|x| x.implementation == "probattn" || x.implementation == "pytorch");
    for &s in &seqs {
        let soft = find("softmax", "probattn", s);
        for &v in measured.iter().filter(|_| eager_rows) {
            let ours = find(v, "probattn", s);
            let theirs = find(v, "pytorch", s);
            let rel = ours.zip(soft).map(|(a, b)| a / b);
            let vs = ours.zip(theirs).map(|(a, b)| a / b);
            let (our_mem, their_mem) = (mem(v, "probattn", s), mem(v, "pytorch", s));
            let mem_ratio = our_mem.zip(their_mem).map(|(a, b)| a / b);
            t += &format!(
                "| {s} | {v} | {} | {} | {} | {} | {} | {} | {} |\n",
                fmt(ours),
                fmt(theirs),
                fmt(rel),
                fmt(vs),
                fmt1(our_mem),
                fmt1(their_mem),
                fmt(mem_ratio)
            );
        }
        let sdpa = find("softmax", "pytorch-sdpa", s);
        let (soft_mem, sdpa_mem) = (mem("softmax", "probattn", s), mem("softmax", "pytorch-sdpa", s));
        for (imp, named) in [(MEMORY_EFFICIENT, "memory-efficient"), (FUSED, "fused")] {
            let own_variants = measured.iter().filter(|&&v| m.iter().any(|x| x.variant == v && x.implementation == imp));
            for &v in own_variants {
                // Against our eager path (unless --no-eager), SDPA's softmax (the price of the
                // variant), and for DNAS its FlexAttention composition where PyTorch's side
                // measured one (CUDA).
                let mut against = vec![("SDPA softmax", "SDPA", "softmax", "pytorch-sdpa")];
                if eager_rows {
                    against.insert(0, ("our eager", "ours, eager", v, "probattn"));
                }
                if v == "dnas" {
                    against.push(("FlexAttention (two calls)", "Flex", "dnas", "pytorch-flex"));
                }
                for (label, short, rv, rimp) in against {
                    let (ours, other) = (find(v, imp, s), find(rv, rimp, s));
                    if other.is_none() && rimp != "probattn" {
                        continue;
                    }
                    let (our_mem, other_mem) = (mem(v, imp, s), mem(rv, rimp, s));
                    t += &versus(s, &format!("{v} {named} vs {label}"), short, (ours, other), (our_mem, other_mem));
                }
            }
        }
        if eager_rows {
            t += &versus(s, "softmax vs SDPA", "SDPA", (soft, sdpa), (soft_mem, sdpa_mem));
        }
    }
    t + &svgd.map(svgd_line).unwrap_or_default()
}

/// The SVGD hook's line under the table.
fn svgd_line(svgd: &SvgdTiming) -> String {
    format!(
        "\nSVGD hook: one Adam step of the 6+6-layer E=512 stack ({} tokens per side) {:.1} ms without, {:.1} ms with (ratio {:.3}; the hook alone {:.1} ms); a step without the hook peaks {:.1} MiB above its start.\n",
        svgd.tokens_per_side,
        svgd.step_ms_without,
        svgd.step_ms_with,
        svgd.ratio,
        svgd.hook_ms,
        svgd.step_peak_bytes as f64 / MIB
    )
}

/// The flops of one forward and backward step of the benchmarked layer, counted for every variant
/// and implementation as FlashAttention counts softmax's: the four projections (2·B·S·E² each
/// forward, twice that backward: 24·B·S·E²) and attention's two products forward and five
/// backward (recomputing the scores), 2·B·H·S²·d each (14·B·H·S²·d, d = E/H). A variant that
/// does more (DNAS's column pass and correction) is counted as softmax, so its TFLOP/s read as
/// inverse times on softmax's scale.
pub fn layer_flops(batch: i64, heads: i64, embed: i64, seq: i64) -> f64 {
    let (b, h, e, s) = (batch as f64, heads as f64, embed as f64, seq as f64);
    24.0 * b * s * e * e + 14.0 * b * h * s * s * (e / h)
}

/// Per sequence length, every measured row's time and its throughput (`layer_flops` over the
/// median time), fastest first.
pub fn throughput_table(m: &[Measurement]) -> String {
    let mut rows: Vec<&Measurement> = m.iter().collect();
    rows.sort_by(|a, b| a.seq_len.cmp(&b.seq_len).then(a.fwd_bwd_ms.total_cmp(&b.fwd_bwd_ms)));
    let mut t = String::from(
        "\nThroughput (layer TFLOP/s: 24·B·S·E² for the projections and 14·B·H·S²·d for attention, softmax's count for every variant):\n\n\
         | S | variant | implementation | route | ms | TFLOP/s |\n|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let tflops = r.tflops.map_or("–".to_string(), |v| format!("{v:.3}"));
        let route = r.route.as_deref().unwrap_or("");
        t += &format!("| {} | {} | {} | {route} | {:.2} | {tflops} |\n", r.seq_len, r.variant, r.implementation, r.fwd_bwd_ms);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::bench::{EMBED, HEADS};
    use probattn::precision::Precision;

    #[test]
    fn the_memory_efficient_rows_compare_with_sdpa_and_flexattention_where_measured() {
        let m = |variant: &str, implementation: &str, ms: f64, mib: u64| Measurement {
            variant: variant.into(),
            implementation: implementation.into(),
            device: "cuda:0".into(),
            batch: 1,
            heads: HEADS,
            embed: EMBED,
            seq_len: 32768,
            fwd_bwd_ms: ms,
            fwd_bwd_ms_iqr: 0.0,
            peak_mem_bytes: Some(mib << 20),
            precision: Precision::F32,
            route: None,
            tflops: None,
        };
        let svgd = SvgdTiming { step_ms_without: 1.0, step_ms_with: 1.0, ratio: 1.0, hook_ms: 0.0, tokens_per_side: 1, step_peak_bytes: 0 };
        let rows = [
            m("dnas", MEMORY_EFFICIENT, 300.0, 64),
            m("softmax", MEMORY_EFFICIENT, 200.0, 48),
            m("softmax", "pytorch-sdpa", 100.0, 32),
            m("dnas", "pytorch-flex", 400.0, 128),
        ];
        let table = ratio_table(&rows, Some(&svgd));
        let line = |start: &str| table.lines().find(|l| l.starts_with(start)).unwrap_or_else(|| panic!("no row {start} in\n{table}"));
        assert_eq!(
            line("| 32768 | dnas memory-efficient vs SDPA softmax |"),
            "| 32768 | dnas memory-efficient vs SDPA softmax | 300.00 | 100.00 (SDPA) | | 3.00 | 64.0 | 32.0 (SDPA) | 2.00 |"
        );
        assert_eq!(
            line("| 32768 | dnas memory-efficient vs FlexAttention (two calls) |"),
            "| 32768 | dnas memory-efficient vs FlexAttention (two calls) | 300.00 | 400.00 (Flex) | | 0.75 | 64.0 | 128.0 (Flex) | 0.50 |"
        );
        // FlexAttention's row is DNAS's alone, and a PyTorch side that was not run adds no rows.
        assert!(!table.contains("softmax memory-efficient vs FlexAttention"), "{table}");
        let without_pytorch = ratio_table(&rows[..2], Some(&svgd));
        assert!(!without_pytorch.contains("SDPA softmax") && !without_pytorch.contains("FlexAttention"), "{without_pytorch}");
        // Without eager rows (--no-eager) there is no comparison with them either.
        assert!(!table.contains("vs our eager"), "{table}");
        // The SVGD hook's line is there where it was timed, and only there (--no-svgd).
        assert!(table.contains("\nSVGD hook: one Adam step"), "{table}");
        assert!(!ratio_table(&rows, None).contains("SVGD"), "{}", ratio_table(&rows, None));
    }

    #[test]
    fn the_layers_flops_count_the_projections_and_softmaxs_seven_products() {
        // B 1, H 1, E 2, S 3: 24·1·3·4 = 288 for the projections, 14·1·1·9·2 = 252 for attention.
        assert_eq!(layer_flops(1, 1, 2, 3), 540.0);
        // Doubling S doubles the projections' share and quadruples attention's.
        let (b, h, e) = (8, HEADS, EMBED);
        let attention = |s: i64| 14.0 * (b * h * s * s * (e / h)) as f64;
        assert_eq!(layer_flops(b, h, e, 2048) - attention(2048), 2.0 * (layer_flops(b, h, e, 1024) - attention(1024)));
        let row = |implementation: &str, ms: f64| Measurement {
            variant: "dnas".into(),
            implementation: implementation.into(),
            device: "cuda:0".into(),
            batch: 1,
            heads: HEADS,
            embed: EMBED,
            seq_len: 4096,
            fwd_bwd_ms: ms,
            fwd_bwd_ms_iqr: 0.0,
            peak_mem_bytes: None,
            precision: Precision::Bf16,
            route: Some("fused-cuda".into()),
            tflops: Some(layer_flops(1, HEADS, EMBED, 4096) / (ms * 1e-3) / 1e12),
        };
        let table = throughput_table(&[row("pytorch-flex", 4.0), row(FUSED, 2.0)]);
        let lines: Vec<&str> = table.lines().filter(|l| l.starts_with("| 4096 |")).collect();
        // Fastest first, with its route, and twice the throughput at half the time.
        assert_eq!(lines[0], "| 4096 | dnas | probattn-fused | fused-cuda | 2.00 | 73.014 |");
        assert_eq!(lines[1], "| 4096 | dnas | pytorch-flex | fused-cuda | 4.00 | 36.507 |");
    }
}
