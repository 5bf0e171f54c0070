//! README's benchmark tables and `docs/iptables-figures.svg` are what `benches/report.py` makes
//! of the JSON in `docs/bench/` (the one benchmark command, `benches/run`, writes both): no
//! figure there is copied by hand, or left behind by a newer run (every `docs/bench/*.json`).

mod common;

/// The report regenerated into a scratch copy changes nothing.
fn readme_and_plot_are_regenerated_from_the_committed_json() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let scratch = std::env::temp_dir().join(format!("kp-bench-report-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    let (readme, svg) = (scratch.join("README.md"), scratch.join("figures.svg"));
    std::fs::copy(root.join("README.md"), &readme).expect("copy README");
    let mut figures: Vec<std::path::PathBuf> = std::fs::read_dir(root.join("docs/bench"))
        .expect("docs/bench")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        // The soak's samples are drawn by their own script (the test below).
        .filter(|p| !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("soak-")))
        .collect();
    figures.sort();
    let status = std::process::Command::new("python3")
        .arg(root.join("benches/report.py"))
        .arg("--readme")
        .arg(&readme)
        .arg("--svg")
        .arg(&svg)
        .args(&figures)
        .status()
        .expect("python3 runs");
    let regenerated = std::fs::read_to_string(&readme).expect("README");
    let drawn = std::fs::read_to_string(&svg).expect("svg");
    let _ = std::fs::remove_dir_all(&scratch);
    assert!(status.success(), "benches/report.py failed");
    let committed = std::fs::read_to_string(root.join("README.md")).expect("README");
    assert!(
        regenerated == committed,
        "README's benchmark tables differ from benches/report.py's: run it"
    );
    let plot = std::fs::read_to_string(root.join("docs/iptables-figures.svg")).expect("svg");
    assert_eq!(
        drawn, plot,
        "docs/iptables-figures.svg differs from benches/report.py's"
    );
}

/// README's soak section and `docs/soak-MODE.svg` are what `benches/soak_plot.py` makes of
/// the committed `docs/bench/soak-MODE.json`.
fn soak_section_and_plots_are_regenerated_from_the_committed_json() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let scratch = std::env::temp_dir().join(format!("kp-soak-report-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    let readme = scratch.join("README.md");
    std::fs::copy(root.join("README.md"), &readme).expect("copy README");
    let modes = ["nftables", "iptables"];
    let status = std::process::Command::new("python3")
        .arg(root.join("benches/soak_plot.py"))
        .arg("--readme")
        .arg(&readme)
        .arg("--svg-dir")
        .arg(&scratch)
        .args(modes.map(|m| root.join(format!("docs/bench/soak-{m}.json"))))
        .status()
        .expect("python3 runs");
    let regenerated = std::fs::read_to_string(&readme).expect("README");
    let drawn = modes.map(|m| std::fs::read_to_string(scratch.join(format!("soak-{m}.svg"))).expect("svg"));
    let _ = std::fs::remove_dir_all(&scratch);
    assert!(status.success(), "benches/soak_plot.py failed");
    let committed = std::fs::read_to_string(root.join("README.md")).expect("README");
    assert!(
        regenerated == committed,
        "README's soak section differs from benches/soak_plot.py's: run it"
    );
    for (m, svg) in modes.iter().zip(drawn) {
        let plot = std::fs::read_to_string(root.join(format!("docs/soak-{m}.svg"))).expect("svg");
        assert_eq!(svg, plot, "docs/soak-{m}.svg differs from benches/soak_plot.py's");
    }
}

common::harness::main! {
    &[Tool("python3")] => readme_and_plot_are_regenerated_from_the_committed_json,
        soak_section_and_plots_are_regenerated_from_the_committed_json;
}
