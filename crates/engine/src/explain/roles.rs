//! Roles of live memory, read from the frames that allocated it, with no code change in the
//! program: parameters, gradients, optimizer state, activations, temporaries, communication
//! buffers, and `other` where the frames do not say. The rules, in the order they are tried
//! (the first that matches wins; docs/EXPLAIN.md lists them too):
//!
//! 1. *communication*: the innermost of PyTorch's Python frames (`torch/...py`) is under
//!    `torch/distributed/` or is DDP's `torch/nn/parallel/distributed.py`, or a frame's file or function names NCCL (`nccl`, `libnccl`).
//! 2. *optimizer_state*: a Python frame under `torch/optim/`.
//! 3. *gradients* / *temporaries*: a backward frame (a function named `backward`,
//!    `_engine_run_backward`, `run_backward` or `grad` in `torch/autograd/` or
//!    `torch/_tensor.py`, or a native `torch::autograd::Engine` frame): gradients when the
//!    block was still live at the end of the file (for a step snapshot: the end of the step),
//!    temporaries when it was freed later within the recorded history.
//! 4. *parameters*: `nn.Module.to`/`cuda`/`_apply` (`torch/nn/modules/module.py`), a frame
//!    of `torch/nn/init.py` or `torch/nn/parameter.py`, or a `reset_parameters` function.
//! 5. *activations*: a `forward` function, or `nn.Module.__call__` (`_call_impl`,
//!    `_wrapped_call_impl`, `__call__` in `torch/nn/modules/module.py`).
//! 6. *other*: nothing above (a stack without frames, a plain CUDA program).
//!
//! Cold code.

use memsnap_format::model::{Frame, Snapshot, StackId};
use serde::Serialize;

/// What a block of memory is for, as far as its frames tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Parameters,
    Gradients,
    OptimizerState,
    Activations,
    Temporaries,
    Communication,
    Other,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Parameters => "parameters",
            Role::Gradients => "gradients",
            Role::OptimizerState => "optimizer_state",
            Role::Activations => "activations",
            Role::Temporaries => "temporaries",
            Role::Communication => "communication",
            Role::Other => "other",
        }
    }
}

/// What a stack's frames say, before knowing whether the block outlived its step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StackRole {
    Known(Role),
    /// A backward frame: gradients if the block survives, temporaries if freed.
    Backward,
}

impl StackRole {
    /// The role of a block of this stack; `freed_later`: freed within the history after
    /// the moment looked at.
    pub fn role(self, freed_later: bool) -> Role {
        match self {
            StackRole::Known(r) => r,
            StackRole::Backward if freed_later => Role::Temporaries,
            StackRole::Backward => Role::Gradients,
        }
    }
}

/// Bytes per role (requested bytes of the live blocks at one moment).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Roles {
    pub parameters: i64,
    pub gradients: i64,
    pub optimizer_state: i64,
    pub activations: i64,
    pub temporaries: i64,
    pub communication: i64,
    pub other: i64,
}

impl Roles {
    pub fn add(&mut self, role: Role, bytes: i64) {
        *self.slot(role) += bytes;
    }
    fn slot(&mut self, role: Role) -> &mut i64 {
        match role {
            Role::Parameters => &mut self.parameters,
            Role::Gradients => &mut self.gradients,
            Role::OptimizerState => &mut self.optimizer_state,
            Role::Activations => &mut self.activations,
            Role::Temporaries => &mut self.temporaries,
            Role::Communication => &mut self.communication,
            Role::Other => &mut self.other,
        }
    }
    /// (role, bytes) largest first, roles with bytes only.
    pub fn rows(&self) -> Vec<(Role, i64)> {
        let mut v = vec![
            (Role::Parameters, self.parameters),
            (Role::Gradients, self.gradients),
            (Role::OptimizerState, self.optimizer_state),
            (Role::Activations, self.activations),
            (Role::Temporaries, self.temporaries),
            (Role::Communication, self.communication),
            (Role::Other, self.other),
        ];
        v.retain(|(_, b)| *b != 0);
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        v
    }
}

fn lower_has(s: &str, needle: &str) -> bool {
    s.to_ascii_lowercase().contains(needle)
}

fn is_module_py(f: &Frame) -> bool {
    f.filename.ends_with("torch/nn/modules/module.py")
}

fn is_backward(f: &Frame) -> bool {
    let torch_autograd =
        f.filename.contains("torch/autograd/") || f.filename.ends_with("torch/_tensor.py");
    (torch_autograd
        && matches!(
            f.name.as_str(),
            "backward" | "_engine_run_backward" | "run_backward" | "grad"
        ))
        || f.name.contains("torch::autograd::Engine")
        || (f.name == "backward" && f.filename.ends_with(".py"))
}

/// The role a stack's frames (innermost first) say.
pub fn of_frames<'f>(frames: impl IntoIterator<Item = &'f Frame>) -> StackRole {
    let frames: Vec<&Frame> = frames.into_iter().collect();
    let any = |p: &dyn Fn(&Frame) -> bool| frames.iter().any(|f| p(f));
    // torch.distributed wraps whole models (FSDP, tensor parallel): only the innermost of
    // PyTorch's Python frames says whether the block is the library's own buffer.
    let innermost_torch = frames
        .iter()
        .find(|f| f.filename.ends_with(".py") && f.filename.contains("torch/"));
    if innermost_torch.is_some_and(|f| {
        f.filename.contains("torch/distributed/")
            || f.filename.ends_with("torch/nn/parallel/distributed.py")
    }) || any(&|f| lower_has(&f.filename, "nccl") || lower_has(&f.name, "nccl"))
    {
        return StackRole::Known(Role::Communication);
    }
    if any(&|f| f.filename.contains("torch/optim/")) {
        return StackRole::Known(Role::OptimizerState);
    }
    if any(&is_backward) {
        return StackRole::Backward;
    }
    if any(&|f| {
        (is_module_py(f) && matches!(f.name.as_str(), "to" | "cuda" | "_apply"))
            || f.filename.ends_with("torch/nn/init.py")
            || f.filename.ends_with("torch/nn/parameter.py")
            || f.name == "reset_parameters"
    }) {
        return StackRole::Known(Role::Parameters);
    }
    if any(&|f| {
        f.name == "forward"
            || (is_module_py(f)
                && matches!(
                    f.name.as_str(),
                    "_call_impl" | "_wrapped_call_impl" | "__call__"
                ))
    }) {
        return StackRole::Known(Role::Activations);
    }
    StackRole::Known(Role::Other)
}

/// The role of every stack of a snapshot, by stack index.
pub fn of_stacks(snap: &Snapshot) -> Vec<StackRole> {
    (0..snap.stacks.len())
        .map(|i| of_frames(snap.stack_frames(Some(i as StackId))))
        .collect()
}

/// The role of a stack (`None`: no frames, `other`).
pub fn of_stack(roles: &[StackRole], stack: Option<StackId>) -> StackRole {
    stack
        .and_then(|s| roles.get(s as usize).copied())
        .unwrap_or(StackRole::Known(Role::Other))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fr(name: &str, file: &str) -> Frame {
        Frame {
            name: name.into(),
            filename: file.into(),
            line: 1,
        }
    }

    const SP: &str = "/venv/lib/python3.12/site-packages/";

    fn role(frames: &[Frame]) -> StackRole {
        of_frames(frames.iter())
    }

    #[test]
    fn each_rule_on_typical_stacks() {
        let module = format!("{SP}torch/nn/modules/module.py");
        let train = "/job/train.py";
        // model.to("cuda"): parameters.
        assert_eq!(
            role(&[
                fr("<lambda>", &module),
                fr("_apply", &module),
                fr("to", &module)
            ]),
            StackRole::Known(Role::Parameters)
        );
        // A layer's forward: activations.
        assert_eq!(
            role(&[
                fr("forward", &format!("{SP}torch/nn/modules/linear.py")),
                fr("_call_impl", &module),
                fr("main", train)
            ]),
            StackRole::Known(Role::Activations)
        );
        // loss.backward(): gradients or temporaries, by lifetime.
        let bw = role(&[
            fr(
                "_engine_run_backward",
                &format!("{SP}torch/autograd/graph.py"),
            ),
            fr("backward", &format!("{SP}torch/autograd/__init__.py")),
            fr("backward", &format!("{SP}torch/_tensor.py")),
            fr("main", train),
        ]);
        assert_eq!(bw, StackRole::Backward);
        assert_eq!(bw.role(false), Role::Gradients);
        assert_eq!(bw.role(true), Role::Temporaries);
        // optimizer.step(): optimizer state, even though it is not forward or backward.
        assert_eq!(
            role(&[
                fr("_init_group", &format!("{SP}torch/optim/adam.py")),
                fr("step", &format!("{SP}torch/optim/adam.py")),
                fr("main", train)
            ]),
            StackRole::Known(Role::OptimizerState)
        );
        // DDP's buckets and NCCL's own buffers: communication.
        assert_eq!(
            role(&[fr(
                "__init__",
                &format!("{SP}torch/distributed/distributed_c10d.py")
            )]),
            StackRole::Known(Role::Communication)
        );
        assert_eq!(
            role(&[fr("ncclMemAlloc", "/usr/lib/libnccl.so.2")]),
            StackRole::Known(Role::Communication)
        );
        // A layer's forward inside an FSDP-wrapped model: activations, not communication.
        assert_eq!(
            role(&[
                fr("forward", &format!("{SP}torch/nn/modules/linear.py")),
                fr("_call_impl", &module),
                fr(
                    "forward",
                    &format!("{SP}torch/distributed/fsdp/fully_sharded_data_parallel.py")
                ),
                fr("main", train)
            ]),
            StackRole::Known(Role::Activations)
        );
        // A plain program, and no frames: other.
        assert_eq!(
            role(&[fr("main", "/src/app.c")]),
            StackRole::Known(Role::Other)
        );
        assert_eq!(role(&[]), StackRole::Known(Role::Other));
    }

    #[test]
    fn roles_sum_and_list_largest_first() {
        let mut r = Roles::default();
        r.add(Role::Activations, 10);
        r.add(Role::Parameters, 30);
        r.add(Role::Activations, 5);
        assert_eq!(r.rows(), [(Role::Parameters, 30), (Role::Activations, 15)]);
    }
}
