//! The `spark-tool` command line: parse, convert to library options, call, print.

mod cli;

use clap::{CommandFactory, FromArgMatches, Subcommand};

#[derive(clap::Parser)]
#[command(
    name = "spark-tool",
    version,
    about = "Spark-X2.5 checkpoint → every device, with CPU parity checks"
)]
struct Cli {
    /// Worker threads for matmuls and attention (default: all cores).
    #[arg(long, global = true, value_parser = cli::at_least_1)]
    threads: Option<usize>,
    #[command(flatten)]
    out: cli::Verbosity,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Summarise a checkpoint: shapes, parameters, bytes per tensor class, KV-cache cost.
    Inspect(cli::inspect::InspectArgs),
    /// Run a checkpoint on CPU: prompt or token ids in, streamed text out.
    Run(cli::run::RunArgs),
    /// Measure prefill and decode throughput of one artifact (min/median/max over repeats).
    Bench(cli::bench::BenchArgs),
    /// Compare an artifact against a reference (greedy, top-1/5, KL, SNR, perplexity); exit 1 on drift.
    Parity(cli::parity::ParityArgs),
    /// Detect this CPU and say which weight format runs best on it (and why).
    Probe(cli::quantize::ProbeArgs),
    /// GPTQ a checkpoint into a W4A8 or W4A16 GPTQ v1 checkpoint (format chosen by the probe) or a GGUF file.
    Quantize(cli::quantize::QuantizeArgs),
    /// Export one decode step as a QNN-ready ONNX graph (calibrated w8a16, w4a16 from GPTQ codes, f16 or f32) with per-layer-type KV caches.
    ExportPhone(cli::export::ExportArgs),
    /// Print a shell completion script: `spark-tool completions bash > /etc/bash_completion.d/spark-tool`.
    Completions {
        /// The shell the script is for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff): `spark-tool man > spark-tool.1`.
    Man,
}

/// The command line, with every option that takes a value accepting a leading `-`: a negative
/// number then reaches the option's own parser, whose message names the flag and the range,
/// instead of clap's "unexpected argument '-1'".
fn parse() -> Cli {
    let values = |a: clap::Arg| {
        if a.get_action().takes_values() && !a.is_positional() {
            a.allow_negative_numbers(true)
        } else {
            a
        }
    };
    let cmd = Cli::command()
        .long_version(long_version())
        .mut_args(values)
        .mut_subcommands(move |sc| sc.mut_args(values));
    let matches = cmd.get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// `--version`: the release, the commit and build profile, and the kernel tier and weight path
/// this CPU gets.
fn long_version() -> String {
    let path = spark_tool::device::decide(
        &spark_tool::device::detect(),
        spark_tool::device::Target::Auto,
        spark_tool::device::Priority::Speed,
    );
    format!(
        "{} (commit {}, {} build)\nkernels: {:?} tier on this CPU\nweight path: {} g{} for {}",
        env!("CARGO_PKG_VERSION"),
        env!("SPARK_COMMIT"),
        env!("SPARK_PROFILE"),
        spark_tool::kernels::isa::isa(),
        serde_json::to_value(path.format)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default(),
        path.group_size,
        path.target
    )
}

/// The error and its causes, each cause added only when the message so far does not already end
/// with it (an error that prints its source as well would otherwise read "x: cause: cause").
fn chain(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !out.ends_with(&c) {
            out = format!("{out}: {c}");
        }
    }
    out
}

/// Ctrl-C, SIGTERM and SIGHUP end the process through [`spark_tool::artifact::exit_on_interrupt`]:
/// what was being written is removed, or kept and named where it can be resumed.
fn interrupt_cleanly() {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    // A signal the parent set to be ignored stays ignored (`nohup`, a `&` job of a script):
    // catching it would end a long run the user meant to survive it.
    let ignored = |sig: i32| {
        // SAFETY: sigaction with a null new action only reads the current one into `old`.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(sig, std::ptr::null(), &mut old) == 0
                && old.sa_sigaction == libc::SIG_IGN
        }
    };
    let wanted: Vec<i32> = [SIGINT, SIGTERM, SIGHUP]
        .into_iter()
        .filter(|&s| !ignored(s))
        .collect();
    match signal_hook::iterator::Signals::new(wanted) {
        Ok(mut signals) => {
            std::thread::spawn(move || {
                if let Some(sig) = signals.forever().next() {
                    spark_tool::artifact::exit_on_interrupt(sig);
                }
            });
        }
        Err(e) => {
            eprintln!("warning: cannot handle interruptions (Ctrl-C leaves staging folders): {e}")
        }
    }
}

/// A write to a closed stdout or stderr ends the process quietly instead of with a panic: Rust
/// ignores SIGPIPE, so `println!` panics on EPIPE, which would print a backtrace hint after
/// `spark-tool inspect | head -1`.
fn quiet_on_closed_output() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if message.starts_with("failed printing to std") && message.contains("Broken pipe") {
            spark_tool::artifact::exit_on_closed_output();
        }
        default(info)
    }));
}

fn main() {
    quiet_on_closed_output();
    let cli = parse();
    if cli.out.quiet && cli.out.verbose {
        // clap checks conflicts within one level only; these two may sit on either side of the command.
        eprintln!("error: --quiet and --verbose ask for less and more output: pass one of them");
        std::process::exit(2);
    }
    spark_tool::setting::spell_with(cli::flag);
    if let Some(n) = cli.threads {
        if let Err(e) = rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global()
        {
            eprintln!("error: cannot start {n} threads: {e}");
            std::process::exit(2);
        }
    }
    interrupt_cleanly();
    let result = match cli.command {
        Command::Inspect(a) => cli::inspect::run(a).map(|_| 0),
        Command::Run(a) => cli::run::run(a, cli.out).map(|_| 0),
        Command::Parity(a) => cli::parity::run(a, cli.out),
        Command::Bench(a) => cli::bench::run(a).map(|_| 0),
        Command::Probe(a) => cli::quantize::probe(a).map(|_| 0),
        Command::Quantize(a) => cli::quantize::run(a, cli.out).map(|_| 0),
        Command::ExportPhone(a) => cli::export::run(a, cli.out),
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "spark-tool",
                &mut std::io::stdout(),
            );
            Ok(0)
        }
        Command::Man => clap_mangen::Man::new(Cli::command().long_version(long_version()))
            .render(&mut std::io::stdout())
            .map(|_| 0)
            .map_err(Into::into),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {}", chain(&e));
            std::process::exit(2);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::CommandFactory;

    /// Every option and argument of every command has a description (`--help` and the man page
    /// show nothing else for it).
    #[test]
    fn every_flag_has_a_description() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for a in cmd.get_arguments() {
                let id = a.get_id().as_str();
                if id != "help" && id != "version" && a.get_help().is_none() {
                    missing.push(format!("{path} {id}"));
                }
            }
            for sc in cmd.get_subcommands() {
                walk(sc, &format!("{path} {}", sc.get_name()), missing);
            }
        }
        let mut cmd = Cli::command();
        cmd.build();
        let mut missing = Vec::new();
        walk(&cmd, "spark-tool", &mut missing);
        assert!(missing.is_empty(), "no description: {missing:?}");
    }

    /// Each command's --help fits a screen (the solve's other choices are recipe keys).
    #[test]
    fn each_commands_help_fits_a_screen() {
        let mut cmd = Cli::command();
        cmd.build();
        for sc in cmd.get_subcommands_mut() {
            let name = sc.get_name().to_string();
            let help = sc.render_help().to_string();
            let lines = help.lines().count();
            assert!(lines <= 60, "{name} --help is {lines} lines:\n{help}");
        }
    }

    /// The lab's options are recipe keys under `[lab]`, never flags of the default build.
    #[test]
    fn quantize_has_no_lab_flags() {
        let mut cmd = Cli::command();
        cmd.build();
        let q = cmd.find_subcommand("quantize").expect("quantize");
        let flags: Vec<String> = q
            .get_arguments()
            .filter_map(|a| a.get_long().map(str::to_string))
            .collect();
        for word in [
            "tune",
            "refit",
            "descent",
            "method",
            "objective",
            "order",
            "damp",
        ] {
            assert!(flags.iter().all(|f| !f.contains(word)), "{word}: {flags:?}");
        }
        assert!(flags.iter().any(|f| f == "recipe") && flags.iter().any(|f| f == "set"));
    }
}
