//! Incremental nightly runs: night 2 reuses night 1's rows by request key, computes only what changed, and
//! keeps exactly-once commits through kill -9; sources of another job serve nothing; an incomplete source is
//! refused unless asked for; a source that disappears mid-run fails the run and leaves its commits intact.
//! Identical requests within a run are computed once.

use super::*;

/// Night 2 of the world's input: every 20th row removed, every 10th (offset 1) changed, 100 new rows at the end.
fn night_two(world: &World) -> (String, Vec<String>, Vec<String>) {
    let (ids, prompts) = (row_ids(ROWS), row_prompts(ROWS));
    let (mut ids2, mut prompts2) = (Vec::new(), Vec::new());
    for (i, (id, prompt)) in ids.into_iter().zip(prompts).enumerate() {
        match i {
            _ if i % 20 == 0 => continue,
            _ if i % 10 == 1 => prompts2.push(format!("{prompt} (updated)")),
            _ => prompts2.push(prompt),
        }
        ids2.push(id);
    }
    for i in 0..100 {
        ids2.push(format!("n{i:05}"));
        prompts2.push(format!("new {i}: {}", WORDS[i % 11]));
    }
    let url = world.input("night2", &ids2, &prompts2);
    let changed = (0..ROWS).filter(|i| i % 20 != 0 && i % 10 == 1).map(|i| format!("r{i:05}")).chain((0..100).map(|i| format!("n{i:05}"))).collect();
    (url, ids2, changed)
}

/// `nightshift plan JOB ARGS --json`, without a calibration run.
fn plan_json(world: &World, job: &Path, args: &[&str]) -> serde_json::Value {
    let out = world.command_for("plan", job).args(args).args(["--calibration-rows", "0", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The columns of a result row that are the computation's (not the run's own: id, timings, reuse columns).
fn computed_part(row: &serde_json::Value) -> serde_json::Value {
    let mut row = row.clone();
    for own in ["id", "queue_s", "ttft_s", "e2e_s", "tpot_s", "request_key", "duplicate_of", "reused_from"] {
        row.as_object_mut().unwrap().remove(own);
    }
    row
}

fn sum(output: &OutputStore, column: &str) -> f64 {
    output.metrics().iter().map(|m| m[column].unwrap()).sum()
}

fn nightly_reuse(store: Store) {
    let world = World::new(&format!("reuse-{store:?}").to_lowercase(), store);
    // Night 1: every row computed.
    world.run(&world.job("night1", "")).assert_ok();
    let night1 = world.output("night1").results_json();
    assert_eq!(night1.len(), ROWS);
    assert!(night1.values().all(|r| r["request_key"].as_str().is_some_and(|k| k.len() == 64) && r.get("reused_from").is_none()));

    // Night 2 reusing night 1: only the changed and new rows are computed.
    let (input2, ids2, changed) = night_two(&world);
    let night1_url = world.output_url("night1");
    let job2 = world.job_over("night2", &input2, "");
    // `plan` says what the source would serve before anything runs.
    let planned = plan_json(&world, &job2, &["--reuse", &night1_url]);
    assert_eq!(planned["reuse"]["reused_rows"], (ids2.len() - changed.len()) as u64, "{planned}");
    assert_eq!((planned["reuse"]["source_keys"].as_u64(), planned["duplicate_rows"].as_u64()), (Some(ROWS as u64), Some(0)));
    assert_eq!(planned["ok_rows"], changed.len() as u64);
    let run = finish(world.spawn_with(&job2, &["--reuse", &night1_url], &[("RUST_LOG", "info")]));
    run.assert_ok();
    let output2 = world.output("night2");
    let rows2 = output2.results_json();
    assert_eq!(output2.ids_in_order(), ids2);
    assert_eq!((sum(&output2, "computed_rows"), sum(&output2, "reused_rows"), sum(&output2, "deduplicated_rows")), (changed.len() as f64, (ids2.len() - changed.len()) as f64, 0.0));
    assert!(run.stdout.contains(&format!("{} reused", ids2.len() - changed.len())), "the summary says it: {}", run.stdout);
    // So does the job report.
    let html = String::from_utf8(output2.get("_report.html").unwrap().to_vec()).unwrap();
    assert!(html.contains("300 computed, 1,700 reused, 0 deduplicated"), "the report's cards count them");
    for (id, row) in &rows2 {
        if changed.contains(id) {
            assert!(row.get("reused_from").is_none(), "{id} was changed or is new: computed");
            continue;
        }
        let reused = &row["reused_from"];
        assert_eq!((reused["url"].as_str(), reused["id"].as_str()), (Some(night1_url.as_str()), Some(id.as_str())), "{id}: {row}");
        // Byte-identical to night 1's row, with night 1's timings kept apart from this run's (which are null).
        assert_eq!(computed_part(row), computed_part(&night1[id]), "{id}");
        assert_eq!(row["request_key"], night1[id]["request_key"]);
        assert_eq!(reused["e2e_s"], night1[id]["e2e_s"]);
        assert!(row.get("e2e_s").is_none() && row.get("ttft_s").is_none(), "{id}: a reused row has no timings of this run: {row}");
    }

    // The same night computed from scratch gives the same rows: reuse changes nothing but the work done.
    world.run(&world.job_over("night2-full", &input2, "")).assert_ok();
    let full = world.output("night2-full").results_json();
    for (id, row) in &rows2 {
        assert_eq!(computed_part(row), computed_part(&full[id]), "{id}: reused or not, the same result");
    }

    // A source of another job (another max_new_tokens) serves nothing, and the log says why once.
    let other = world.job_with("night2-other", &input2, "max_new_tokens = 11", "");
    let run = finish(world.spawn_with(&other, &["--reuse", &night1_url], &[]));
    run.assert_ok();
    assert_eq!(sum(&world.output("night2-other"), "reused_rows"), 0.0);
    assert_eq!(run.stderr.matches("reuse source is of another job").count(), 1, "{}", run.stderr);
    assert!(run.stderr.contains("max_new_tokens 12 vs 11"), "{}", run.stderr);

    // Night 1's result files rewritten by pyarrow (which names a list's items `element`, where arrow-rs says
    // `item`): the same data, read as this run's types, serves the same rows.
    if store == Store::Local {
        let copy = world.dir.join("night1-pyarrow");
        let status = Command::new("cp").args(["-r", &night1_url, copy.to_str().unwrap()]).status().unwrap();
        assert!(status.success());
        let script = "import glob, sys, pyarrow.parquet as pq\n\
                      files = glob.glob(sys.argv[1] + '/data/**/*.parquet', recursive=True)\n\
                      for f in files: pq.write_table(pq.read_table(f), f)\n\
                      print(len(files), pq.ParquetFile(files[0]).schema)";
        let out = Command::new("python3").args(["-c", script, copy.to_str().unwrap()]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("element"), "pyarrow's lists name their items `element`: {}", String::from_utf8_lossy(&out.stdout));
        let job = world.job_over("night2-pyarrow", &input2, "");
        finish(world.spawn_with(&job, &["--reuse", copy.to_str().unwrap()], &[])).assert_ok();
        let output = world.output("night2-pyarrow");
        assert_eq!(sum(&output, "reused_rows"), (ids2.len() - changed.len()) as f64);
        let rows = output.results_json();
        for (id, row) in &rows2 {
            assert_eq!(computed_part(&rows[id]), computed_part(row), "{id}");
        }

        // A forged source: three rows night 2 reuses get keys that share only their first 128 bits (the
        // index's) with the real ones, and other text. They are not served but computed; the rest is reused.
        let forged_dir = world.dir.join("night1-forged");
        let status = Command::new("cp").args(["-r", &night1_url, forged_dir.to_str().unwrap()]).status().unwrap();
        assert!(status.success());
        let script = "import glob, sys, pyarrow as pa, pyarrow.parquet as pq\n\
                      served = set(sys.argv[2].split(','))\n\
                      f = sorted(glob.glob(sys.argv[1] + '/data/**/*.parquet', recursive=True))[0]\n\
                      t = pq.read_table(f)\n\
                      keys, texts, ids = (t.column(c).to_pylist() for c in ('request_key', 'text', 'id'))\n\
                      forged = [i for i in range(len(ids)) if ids[i] in served][:3]\n\
                      for i in forged:\n    \
                          keys[i] = keys[i][:32] + ('0' * 32 if keys[i][32:] != '0' * 32 else '1' * 32)\n    \
                          texts[i] = 'FORGED'\n\
                      for name, values in (('request_key', keys), ('text', texts)):\n    \
                          k = t.schema.get_field_index(name)\n    \
                          t = t.set_column(k, t.schema.field(k), pa.array(values, t.schema.field(k).type))\n\
                      pq.write_table(t, f)\n\
                      print(','.join(ids[i] for i in forged))";
        let served: Vec<&str> = ids2.iter().filter(|id| !changed.contains(id)).map(String::as_str).collect();
        let out = Command::new("python3").args(["-c", script, forged_dir.to_str().unwrap(), &served.join(",")]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let forged: Vec<String> = String::from_utf8_lossy(&out.stdout).trim().split(',').map(str::to_string).collect();
        assert_eq!(forged.len(), 3, "{forged:?}");
        let job = world.job_over("night2-forged", &input2, "");
        let run = finish(world.spawn_with(&job, &["--reuse", forged_dir.to_str().unwrap()], &[]));
        run.assert_ok();
        assert!(run.stderr.contains("holds another key") && run.stderr.contains("rows=3"), "{}", run.stderr);
        let output = world.output("night2-forged");
        assert_eq!(sum(&output, "reused_rows"), (ids2.len() - changed.len() - 3) as f64);
        assert_eq!(sum(&output, "computed_rows"), (changed.len() + 3) as f64);
        let rows = output.results_json();
        for (id, row) in &rows2 {
            assert_eq!(computed_part(&rows[id]), computed_part(row), "{id}");
            assert_eq!(rows[id].get("reused_from").is_none(), changed.contains(id) || forged.contains(id), "{id}");
        }
    }
}

on_every_store!(nightly_reuse, nightly_reuse_local, nightly_reuse_s3, nightly_reuse_azure);

/// kill -9 with reuse on, an incomplete source, and a source that disappears mid-run.
fn reuse_through_kills_and_lost_sources(store: Store) {
    let world = World::new(&format!("reuse-kill-{store:?}").to_lowercase(), store);
    world.run(&world.job("night1", "")).assert_ok();
    let night1_url = world.output_url("night1");
    let (input2, ids2, changed) = night_two(&world);
    let reuse = ["--reuse", night1_url.as_str()];

    // Killed after its first commit, then rerun: every row once, as an uninterrupted run writes it.
    let job = world.job_over("killed", &input2, "");
    let output = world.output("killed");
    let mut child = world.spawn_with(&job, &reuse, &[]);
    let committed_before_kill = wait_for_first_commit(&mut child, &output);
    let _ = child.kill();
    finish(child);
    let partial = output.list("_commits").len();
    eprintln!("killed after its first commit: {partial} units committed, complete: {}", output.exists("_SUCCESS"));
    // A source without `_SUCCESS` is refused, naming it and how to allow it; allowed, it serves its committed units.
    let killed_url = world.output_url("killed");
    let refuse = world.job_over("from-partial", &input2, "");
    let run = finish(world.spawn_with(&refuse, &["--reuse", &killed_url], &[]));
    if !output.exists("_SUCCESS") {
        assert_eq!(run.code, 3, "{}", run.stderr);
        assert!(run.stderr.contains("is incomplete") && run.stderr.contains("--reuse-incomplete"), "{}", run.stderr);
        let run = finish(world.spawn_with(&refuse, &["--reuse", &killed_url, "--reuse-incomplete"], &[]));
        run.assert_ok();
        let served = sum(&world.output("from-partial"), "reused_rows");
        assert!(committed_before_kill && served > 0.0 && served <= (partial * UNIT_ROWS) as f64, "{served} rows from {partial} units");
    }
    while !output.exists("_SUCCESS") {
        world.spawn_with(&job, &reuse, &[]).wait().unwrap();
    }
    let rows = output.results_json();
    assert_eq!(output.ids_in_order(), ids2, "every row once, in input order");
    assert_eq!(output.list("_commits").len(), output.list("data").len(), "one file per unit");
    let computed: f64 = sum(&output, "computed_rows");
    assert_eq!(computed + sum(&output, "reused_rows"), ids2.len() as f64);
    assert!(computed >= changed.len() as f64);
    let night1 = world.output("night1").results_json();
    for id in ids2.iter().filter(|id| !changed.contains(id)) {
        assert_eq!(computed_part(&rows[id]), computed_part(&night1[id]), "{id}");
    }

    // SIGTERM with reuse on: the run drains (exit 75, or 0 if it finished), a rerun completes it, every row once.
    let job = world.job_over("drained", &input2, "");
    let output = world.output("drained");
    let mut child = world.spawn_with(&job, &reuse, &[]);
    assert!(wait_for_first_commit(&mut child, &output), "the run ended before its first commit");
    signal(&child, "TERM");
    let run = finish(child);
    assert!(run.code == 75 || (run.code == 0 && output.exists("_SUCCESS")), "{}", run.stderr);
    eprintln!("SIGTERM with reuse: exit {}, {} unit(s) committed", run.code, output.list("_commits").len());
    if run.code == 75 {
        world.run(&job).assert_ok();
    }
    assert_eq!(output.ids_in_order(), ids2);
    assert_eq!(sum(&output, "computed_rows") + sum(&output, "reused_rows"), ids2.len() as f64);
    let drained = output.results_json();
    for id in ids2.iter().filter(|id| !changed.contains(id)) {
        assert_eq!(computed_part(&drained[id]), computed_part(&night1[id]), "{id}");
    }

    // The source's result files deleted while a run reads them: the run fails (exit 3) naming the source, and the
    // units it committed stay; a rerun without the source completes the output.
    let job = world.job_over("lost", &input2, "");
    let output = world.output("lost");
    let source = world.output("night1");
    let mut child = world.spawn_with(&job, &reuse, &[]);
    assert!(wait_for_first_commit(&mut child, &output), "the run ended before its first commit");
    signal(&child, "STOP");
    for file in source.list("data") {
        source.delete(&file);
    }
    signal(&child, "CONT");
    let run = finish(child);
    let committed = output.list("_commits").len();
    eprintln!("a source lost mid-run: exit {}, {committed} unit(s) committed", run.code);
    if !output.exists("_SUCCESS") {
        assert_eq!(run.code, 3, "{}", run.stderr);
        assert!(run.stderr.contains(&format!("reuse source `{night1_url}` cannot be read")), "{}", run.stderr);
        assert!(committed >= 1);
        world.run(&job).assert_ok();
    }
    assert_eq!(output.ids_in_order(), ids2);
}

on_every_store!(reuse_through_kills_and_lost_sources, reuse_through_kills_and_lost_sources_local, reuse_through_kills_and_lost_sources_s3, reuse_through_kills_and_lost_sources_azure);

/// 30 % of rows repeat an earlier row's prompt under their own id: each distinct request is computed once, and
/// every copy equals its original.
#[test]
fn identical_requests_are_computed_once() {
    let world = World::new("dedup", Store::Local);
    let (ids, mut prompts) = (row_ids(ROWS), row_prompts(ROWS));
    for i in 0..ROWS {
        if i % 10 == 3 || i % 10 == 6 || i % 10 == 9 {
            prompts[i] = prompts[i - 1].clone();
        }
    }
    let input = world.input("dups", &ids, &prompts);
    let job = world.job_over("dedup", &input, "");
    assert_eq!(plan_json(&world, &job, &[])["duplicate_rows"], (ROWS * 3 / 10) as u64);
    world.run(&job).assert_ok();
    let output = world.output("dedup");
    let rows = output.results_json();
    let duplicates = ROWS * 3 / 10;
    assert_eq!((sum(&output, "deduplicated_rows"), sum(&output, "computed_rows")), (duplicates as f64, (ROWS - duplicates) as f64));
    let html = String::from_utf8(output.get("_report.html").unwrap().to_vec()).unwrap();
    assert!(html.contains("1,400 computed, 0 reused, 600 deduplicated"), "the report's cards count them");
    let distinct: std::collections::BTreeSet<&str> = rows.values().map(|r| r["request_key"].as_str().unwrap()).collect();
    assert_eq!(distinct.len(), ROWS - duplicates);
    for (i, id) in ids.iter().enumerate() {
        let row = &rows[id];
        match row.get("duplicate_of").and_then(|d| d.as_str()) {
            Some(of) => {
                // The first row with the prompt was computed; chains (i-2 -> i-1 -> i) lead to it.
                let first = (0..=i).find(|&j| prompts[j] == prompts[i]).unwrap();
                assert_eq!(of, ids[first], "{id}");
                assert_eq!(computed_part(row), computed_part(&rows[of]), "{id}");
                assert_eq!(row["request_key"], rows[of]["request_key"]);
            }
            None => assert!(i == 0 || prompts[i] != prompts[i - 1], "{id} repeats {} but was computed", ids[i - 1]),
        }
    }
    // The engine ran only the distinct requests' prompts.
    let reference = world.run(&world.job("reference", ""));
    reference.assert_ok();
    assert!(sum(&output, "prefill_tokens") < sum(&world.output("reference"), "prefill_tokens") * 0.8);
}
