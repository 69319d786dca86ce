//! Tests of the site rules: which frame is the site, `--ignore`, `--callers`, helpers.

use super::*;

/// The site of one stack, no helper applied.
fn plain(frames: &[&Frame], attr: &Attribution) -> Site {
    site_of(frames, attr)
}

fn fr(name: &str, file: &str, line: i64) -> Frame {
    Frame {
        name: name.into(),
        filename: file.into(),
        line,
    }
}

#[test]
fn site_prefers_user_python_then_native_outside_runtime() {
    let none = Attribution::default();
    let torch = fr(
        "forward",
        "/x/site-packages/torch/nn/modules/linear.py",
        125,
    );
    let user = fr("<module>", "/srv/job/train.py", 36);
    let s = plain(&[&torch, &user], &none);
    assert_eq!(s.text, "/srv/job/train.py:36 (<module>)");
    let s = plain(&[&torch], &none);
    assert_eq!(s.text, "torch/nn/modules/linear.py:125 (forward)");
    let rt = fr("cudaMalloc", "/usr/lib/libcudart.so.12", 0);
    let alloc = fr(
        "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(unsigned long)",
        "??",
        0,
    );
    let nccl = fr("ncclMemAlloc", "/usr/lib/libnccl.so.2", 0);
    let op = fr(
        "void at::native::gpu_reduce_kernel<float, 4>(at::TensorIterator&)",
        "Reduce.cuh",
        10,
    );
    assert_eq!(
        plain(&[&rt, &nccl], &none).text,
        "ncclMemAlloc (libnccl.so.2)"
    );
    assert_eq!(
        plain(&[&rt, &alloc, &op], &none).text,
        "at::native::gpu_reduce_kernel (Reduce.cuh:10)"
    );
    assert_eq!(library_of(&[&rt, &nccl]), Library::Nccl);
    assert_eq!(library_of(&[&rt, &alloc, &op]), Library::Torch);
    assert_eq!(library_of(&[&rt]), Library::Cudart);
    assert_eq!(
        library_of(&[&rt, &fr("main", "/src/app.cpp", 7)]),
        Library::App
    );
    assert_eq!(
        library_of(&[&rt, &fr("cublasLtMatmul", "libcublasLt.so.12", 0)]),
        Library::Cublas
    );
    assert_eq!(library_of(&[]), Library::Unknown);
}

#[test]
fn ignore_moves_the_site_to_the_caller_and_callers_are_shown() {
    // A helper that every allocation goes through, as pyalloc.py's cuda_alloc.
    let rt = fr("cudaMalloc", "/usr/lib/libcudart.so.13", 0);
    let helper = fr("cuda_alloc", "/srv/app/pyalloc.py", 12);
    let keeper = fr("remember_me", "/srv/app/main.py", 30);
    let outer = fr("<module>", "/srv/app/main.py", 41);
    let stack = [&rt, &helper, &keeper, &outer];
    let none = Attribution::default();
    assert_eq!(
        plain(&stack, &none).text,
        "/srv/app/pyalloc.py:12 (cuda_alloc)"
    );
    let skip = Attribution {
        ignore: vec!["pyalloc.py".into()],
        callers: None,
        ..Attribution::default()
    };
    assert_eq!(
        plain(&stack, &skip).text,
        "/srv/app/main.py:30 (remember_me)"
    );
    // A function name matches too.
    let skip_fn = Attribution {
        ignore: vec!["cuda_alloc".into()],
        callers: None,
        ..Attribution::default()
    };
    assert_eq!(
        plain(&stack, &skip_fn).text,
        "/srv/app/main.py:30 (remember_me)"
    );
    let callers = Attribution {
        ignore: Vec::new(),
        callers: Some(2),
        ..Attribution::default()
    };
    assert_eq!(
        plain(&stack, &callers).text,
        "/srv/app/pyalloc.py:12 (cuda_alloc) <- /srv/app/main.py:30 (remember_me) <- /srv/app/main.py:41 (<module>)"
    );
    let both = Attribution {
        ignore: vec!["pyalloc.py".into()],
        callers: Some(5),
        ..Attribution::default()
    };
    assert_eq!(
        plain(&stack, &both).text,
        "/srv/app/main.py:30 (remember_me) <- /srv/app/main.py:41 (<module>)"
    );
    // Everything ignored: said so.
    let all = Attribution {
        ignore: vec!["/".into()],
        callers: None,
        ..Attribution::default()
    };
    let s = plain(&stack, &all);
    assert_eq!(
        (s.text.as_str(), s.kind),
        ("<every frame matched --ignore>", SiteKind::None)
    );
    // Native sites: the first frame outside the runtime that is not ignored.
    let op = fr(
        "at::native::addmm_out_cuda_impl(at::Tensor&)+0x4c",
        "/t/libtorch_cuda.so",
        0,
    );
    let app = fr("main", "/src/app.cpp", 7);
    assert_eq!(
        plain(&[&rt, &op, &app], &none).text,
        "at::native::addmm_out_cuda_impl+0x4c (libtorch_cuda.so)"
    );
    let skip_torch = Attribution {
        ignore: vec!["libtorch".into()],
        callers: None,
        ..Attribution::default()
    };
    assert_eq!(
        plain(&[&rt, &op, &app], &skip_torch).text,
        "main (app.cpp:7)"
    );
}

#[test]
fn native_frames_keep_their_symbol_offset_and_name_the_library_once() {
    let f = fr("cublasLtMatmul+0x3a7b20", "/usr/lib/libcublasLt.so.13", 0);
    assert_eq!(
        native_text(&f),
        "cublasLtMatmul+0x3a7b20 (libcublasLt.so.13)"
    );
    let f = fr("libcublas.so.13+0x1a2b3c", "/usr/lib/libcublas.so.13", 0);
    assert_eq!(native_text(&f), "libcublas.so.13+0x1a2b3c");
    let f = fr(
        "void at::f<int>(at::Tensor const&)+0x10",
        "/t/libtorch_cuda.so",
        0,
    );
    assert_eq!(native_text(&f), "at::f+0x10 (libtorch_cuda.so)");
    // `+0x` not followed by hex only is part of the name.
    let f = fr("operator+0xyz", "??", 0);
    assert_eq!(native_text(&f), "operator+0xyz");
}

/// The sites of `stacks` (frame lists, innermost first) that allocated `bytes` each, under
/// `attr`: (text, via) per stack.
fn sites_of(stacks: &[(&[&Frame], i64)], attr: &Attribution) -> Vec<(String, Option<String>)> {
    let mut frames: Vec<Frame> = Vec::new();
    let mut ids: Vec<Vec<u32>> = Vec::new();
    let mut bytes = StackBytes::default();
    for (i, (fs, b)) in stacks.iter().enumerate() {
        ids.push(
            fs.iter()
                .map(|f| {
                    frames.push((*f).clone());
                    frames.len() as u32 - 1
                })
                .collect(),
        );
        bytes.add(Some(i as u32), *b);
    }
    let sites = Sites::of_stacks(&frames, &ids, false, attr, &bytes);
    (0..ids.len())
        .map(|i| {
            let s = sites.site(Some(i as u32));
            (sites.text(s).to_string(), sites.via(s).map(str::to_string))
        })
        .collect()
}

fn texts(sites: &[(String, Option<String>)]) -> Vec<&str> {
    sites.iter().map(|(t, _)| t.as_str()).collect()
}

#[test]
fn a_wrapper_called_from_several_lines_shows_its_callers() {
    // A C wrapper around cudaMalloc, called from three lines.
    let rt = fr("cudaMalloc", "/usr/lib/libcudart.so.13", 0);
    let wrapper = fr("device_alloc", "/src/loop.c", 24);
    let (a, b, c) = (
        fr("load_batch", "/src/loop.c", 37),
        fr("forward", "/src/loop.c", 43),
        fr("keep_batch", "/src/loop.c", 57),
    );
    let main = fr("main", "/src/loop.c", 90);
    let stacks: [(&[&Frame], i64); 3] = [
        (&[&rt, &wrapper, &a, &main], 3 << 20),
        (&[&rt, &wrapper, &b, &main], 4 << 20),
        (&[&rt, &wrapper, &c, &main], 1 << 20),
    ];
    let by_default = sites_of(&stacks, &Attribution::default());
    assert_eq!(
        texts(&by_default),
        [
            "load_batch (loop.c:37) via device_alloc (loop.c:24)",
            "forward (loop.c:43) via device_alloc (loop.c:24)",
            "keep_batch (loop.c:57) via device_alloc (loop.c:24)",
        ]
    );
    assert!(
        by_default
            .iter()
            .all(|(_, via)| via.as_deref() == Some("device_alloc (loop.c:24)"))
    );
    // Switched off, or with the callers asked for: the wrapper's own line.
    let off = Attribution {
        helpers: HelperRule::Off,
        ..Attribution::default()
    };
    assert_eq!(
        sites_of(&stacks, &off),
        vec![("device_alloc (loop.c:24)".to_string(), None); 3]
    );
    let chain = Attribution {
        callers: Some(1),
        ..Attribution::default()
    };
    assert_eq!(
        texts(&sites_of(&stacks, &chain))[2],
        "device_alloc (loop.c:24) <- keep_batch (loop.c:57)"
    );
    // One calling line, or one that holds more than 90% of the bytes: no helper.
    assert_eq!(
        texts(&sites_of(&stacks[..1], &Attribution::default())),
        ["device_alloc (loop.c:24)"]
    );
    let lopsided: [(&[&Frame], i64); 2] = [
        (&[&rt, &wrapper, &a, &main], 95),
        (&[&rt, &wrapper, &c, &main], 5),
    ];
    assert_eq!(
        texts(&sites_of(&lopsided, &Attribution::default())),
        ["device_alloc (loop.c:24)"; 2]
    );
    // A line that allocated nothing the file records does not make a helper.
    let unrecorded: [(&[&Frame], i64); 2] = [
        (&[&rt, &wrapper, &a, &main], 100),
        (&[&rt, &wrapper, &c, &main], 0),
    ];
    assert_eq!(
        texts(&sites_of(&unrecorded, &Attribution::default())),
        ["device_alloc (loop.c:24)"; 2]
    );
}

#[test]
fn a_cache_get_that_calls_an_alloc_is_one_helper_named_at_its_callers() {
    // alloc is called from get only; get from two lines, through torch's module call.
    let alloc = fr("alloc", "/job/cache.py", 5);
    let get = fr("get", "/job/cache.py", 12);
    let torch = fr(
        "_call_impl",
        "/venv/lib/python3.12/site-packages/torch/nn/modules/module.py",
        1762,
    );
    let step = fr("step", "/job/train.py", 88);
    let eval = fr("evaluate", "/job/train.py", 120);
    let module = fr("<module>", "/job/train.py", 140);
    let stacks: [(&[&Frame], i64); 2] = [
        (&[&alloc, &get, &torch, &step, &module], 60),
        (&[&alloc, &get, &torch, &eval, &module], 40),
    ];
    let sites = sites_of(&stacks, &Attribution::default());
    assert_eq!(
        sites[0],
        (
            "/job/train.py:88 (step) via /job/cache.py:12 (get)".to_string(),
            Some("/job/cache.py:12 (get)".to_string())
        )
    );
    assert_eq!(
        sites[1].0,
        "/job/train.py:120 (evaluate) via /job/cache.py:12 (get)"
    );
    // A single path up to a module-level line: one caller, no helper.
    let single: [(&[&Frame], i64); 1] = [(&[&alloc, &get, &torch, &step, &module], 60)];
    assert_eq!(
        texts(&sites_of(&single, &Attribution::default())),
        ["/job/cache.py:5 (alloc)"]
    );
}

#[test]
fn a_module_level_line_is_never_a_helper_and_the_frames_below_are_its_callees() {
    // A script's top-level line calling into torch, which allocates from many of its own
    // lines: those are callees, and the line is the site, alone.
    let line = fr("<module>", "/job/train.py", 21);
    let dropout = fr(
        "dropout",
        "/venv/lib/python3.12/site-packages/torch/nn/functional.py",
        1443,
    );
    let linear = fr(
        "forward",
        "/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py",
        134,
    );
    let bootstrap = fr("<module>", "<string>", 1);
    let stacks: [(&[&Frame], i64); 3] = [
        (&[&dropout, &line], 50),
        (&[&linear, &line], 30),
        (&[&linear, &line, &bootstrap], 20),
    ];
    assert_eq!(
        sites_of(&stacks, &Attribution::default()),
        vec![("/job/train.py:21 (<module>)".to_string(), None); 3]
    );
    let found = Attribution::default().helpers_of(
        &[dropout.clone(), line.clone()],
        &[vec![0, 1]],
        &StackBytes::default(),
    );
    assert!(found.is_empty());
    // Framework code is never a helper either: with no user frame, torch's own line is the
    // site however many torch lines call it.
    let f = fr(
        "softmax",
        "/venv/lib/python3.12/site-packages/torch/nn/functional.py",
        2140,
    );
    let (c1, c2) = (
        fr(
            "forward",
            "/venv/lib/python3.12/site-packages/torch/nn/modules/activation.py",
            1670,
        ),
        fr(
            "forward",
            "/venv/lib/python3.12/site-packages/torch/nn/modules/activation.py",
            1680,
        ),
    );
    let framework: [(&[&Frame], i64); 2] = [(&[&f, &c1], 50), (&[&f, &c2], 50)];
    assert_eq!(
        texts(&sites_of(&framework, &Attribution::default())),
        ["torch/nn/functional.py:2140 (softmax)"; 2]
    );
}

#[test]
fn helpers_found_in_several_files_are_applied_to_each() {
    let rt = fr("cudaMalloc", "/usr/lib/libcudart.so.13", 0);
    let wrapper = fr("device_alloc", "/src/loop.c", 24);
    let (a, b) = (fr("load", "/src/loop.c", 37), fr("keep", "/src/loop.c", 57));
    let frames = vec![rt.clone(), wrapper.clone(), a.clone(), b.clone()];
    let both = vec![vec![0, 1, 2], vec![0, 1, 3]];
    let mut bytes = StackBytes::default();
    bytes.add(Some(0), 10);
    bytes.add(Some(1), 10);
    let attr = Attribution::default();
    let here = attr.helpers_of(&frames, &both, &bytes);
    assert_eq!(
        here.names().collect::<Vec<_>>(),
        ["device_alloc (loop.c:24)"]
    );
    // A file where only `keep` called it: no helper of its own, and its site would differ
    // under the shared helpers.
    let one = vec![vec![0, 1, 3]];
    let alone = attr.helpers_of(&frames, &one, &bytes);
    assert!(alone.is_empty());
    let mut shared = alone.clone();
    shared.union(&here);
    assert!(!alone.agrees_with(&shared) && here.agrees_with(&shared));
    let given = attr.with_helpers(shared);
    let sites = Sites::of_stacks(&frames, &one, false, &given, &StackBytes::default());
    assert_eq!(
        sites.text(sites.site(Some(0))),
        "keep (loop.c:57) via device_alloc (loop.c:24)"
    );
    // A file that never reached the wrapper agrees with any helpers.
    let elsewhere = attr.helpers_of(&frames, &[vec![0, 2]], &bytes);
    assert!(elsewhere.agrees_with(&here));
    // Off stays off.
    let off = Attribution {
        helpers: HelperRule::Off,
        ..Attribution::default()
    };
    assert_eq!(off.with_helpers(here).helpers, HelperRule::Off);
}
