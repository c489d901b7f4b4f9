//! The buffers of a TorchScript archive, read from the file itself.
//!
//! libtorch's C API as tch 0.24 exposes it lists a loaded module's parameters but not its
//! buffers (BatchNorm's running statistics, registered constants). A TorchScript archive holds
//! both: `<name>/code/**.py` declares each class's `__buffers__`, and `<name>/data.pkl` is the
//! module tree, pickled (protocol 2) with every tensor's data in `<name>/data/<key>`. This module
//! reads the two: a small unpickler for the opcodes TorchScript writes (unknown ones are a named
//! error, never a guess), the class declarations, and a walk of the tree from the root object
//! that yields each declared buffer under its dotted name, with the value saved in the file.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use tch::{Kind, Tensor};

use crate::{Error, Result};

/// A value of the pickled module tree.
#[derive(Clone, Debug)]
enum Value {
    /// `None`, a bool, a float, or what a REDUCE built that finding buffers does not need.
    Other,
    Int(i64),
    Str(String),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    /// `module name` of a GLOBAL.
    Global(String),
    /// An instance of a class (a TorchScript module or object) and its state (BUILD).
    Object { class: String, state: Box<Value> },
    /// A persistent id: a tensor's storage, `(dtype, key, numel)`.
    Storage { kind: Kind, key: String },
    /// `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`.
    Tensor { kind: Kind, key: String, offset: i64, size: Vec<i64>, stride: Vec<i64> },
}

fn bad(path: &Path, what: String) -> Error {
    Error::File { path: path.into(), message: format!("reading its buffers: {what}") }
}

fn storage_kind(class: &str) -> Option<Kind> {
    Some(match class.rsplit(' ').next()? {
        "FloatStorage" => Kind::Float,
        "DoubleStorage" => Kind::Double,
        "HalfStorage" => Kind::Half,
        "BFloat16Storage" => Kind::BFloat16,
        "LongStorage" => Kind::Int64,
        "IntStorage" => Kind::Int,
        "ShortStorage" => Kind::Int16,
        "CharStorage" => Kind::Int8,
        "ByteStorage" => Kind::Uint8,
        "BoolStorage" => Kind::Bool,
        _ => return None,
    })
}

fn ints(v: &Value) -> Option<Vec<i64>> {
    match v {
        Value::Tuple(xs) | Value::List(xs) => xs.iter().map(|x| if let Value::Int(i) = x { Some(*i) } else { None }).collect(),
        _ => None,
    }
}

/// Unpickles the opcodes TorchScript's `data.pkl` uses.
fn unpickle(bytes: &[u8], path: &Path) -> Result<Value> {
    let err = |what: String| bad(path, format!("data.pkl: {what}"));
    let (mut stack, mut marks, mut memo): (Vec<Value>, Vec<usize>, HashMap<u32, Value>) = (vec![], vec![], HashMap::new());
    let mut i = 0usize;
    let take = |i: &mut usize, n: usize| -> Result<&[u8]> {
        let s = bytes.get(*i..*i + n).ok_or_else(|| err("truncated".into()))?;
        *i += n;
        Ok(s)
    };
    let line = |i: &mut usize| -> Result<String> {
        let end = bytes[*i..].iter().position(|&b| b == b'\n').ok_or_else(|| err("unterminated GLOBAL".into()))?;
        let s = String::from_utf8_lossy(&bytes[*i..*i + end]).into_owned();
        *i += end + 1;
        Ok(s)
    };
    let pop = |stack: &mut Vec<Value>| stack.pop().ok_or_else(|| err("stack underflow".into()));
    let pop_mark = |stack: &mut Vec<Value>, marks: &mut Vec<usize>| -> Result<Vec<Value>> {
        let m = marks.pop().ok_or_else(|| err("MARK missing".into()))?;
        Ok(stack.split_off(m))
    };
    loop {
        let op = *bytes.get(i).ok_or_else(|| err("no STOP".into()))?;
        i += 1;
        match op {
            0x80 => i += 1,                                         // PROTO
            0x95 => i += 8,                                         // FRAME
            b'.' => return pop(&mut stack),                         // STOP
            b'(' => marks.push(stack.len()),                        // MARK
            b'N' => stack.push(Value::Other),                       // NONE
            0x88 | 0x89 => stack.push(Value::Other),                // NEWTRUE, NEWFALSE
            b')' => stack.push(Value::Tuple(vec![])),               // EMPTY_TUPLE
            b']' => stack.push(Value::List(vec![])),                // EMPTY_LIST
            b'}' => stack.push(Value::Dict(vec![])),                // EMPTY_DICT
            b'K' => stack.push(Value::Int(take(&mut i, 1)?[0] as i64)), // BININT1
            b'M' => {
                let b = take(&mut i, 2)?;
                stack.push(Value::Int(u16::from_le_bytes([b[0], b[1]]) as i64))
            }
            b'J' => {
                let b = take(&mut i, 4)?;
                stack.push(Value::Int(i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64))
            }
            0x8a => {
                // LONG1: little-endian two's complement of n bytes
                let n = take(&mut i, 1)?[0] as usize;
                let b = take(&mut i, n)?;
                if n > 8 {
                    return Err(err(format!("an integer of {n} bytes")));
                }
                let mut v: i64 = 0;
                for (k, &byte) in b.iter().enumerate() {
                    v |= (byte as i64) << (8 * k);
                }
                if n > 0 && n < 8 && b[n - 1] & 0x80 != 0 {
                    v -= 1i64 << (8 * n);
                }
                stack.push(Value::Int(v))
            }
            b'G' => {
                take(&mut i, 8)?; // BINFLOAT
                stack.push(Value::Other)
            }
            b'X' | 0x8c => {
                // BINUNICODE (4-byte length), SHORT_BINUNICODE (1-byte length)
                let n = if op == b'X' {
                    let b = take(&mut i, 4)?;
                    u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize
                } else {
                    take(&mut i, 1)?[0] as usize
                };
                stack.push(Value::Str(String::from_utf8_lossy(take(&mut i, n)?).into_owned()))
            }
            b'c' => {
                let module = line(&mut i)?;
                let name = line(&mut i)?;
                stack.push(Value::Global(format!("{module} {name}")))
            }
            0x93 => {
                // STACK_GLOBAL
                let name = pop(&mut stack)?;
                let module = pop(&mut stack)?;
                match (module, name) {
                    (Value::Str(m), Value::Str(n)) => stack.push(Value::Global(format!("{m} {n}"))),
                    _ => return Err(err("STACK_GLOBAL without strings".into())),
                }
            }
            b'q' => {
                let k = take(&mut i, 1)?[0] as u32;
                memo.insert(k, stack.last().cloned().ok_or_else(|| err("BINPUT on an empty stack".into()))?);
            }
            b'r' => {
                let b = take(&mut i, 4)?;
                memo.insert(u32::from_le_bytes([b[0], b[1], b[2], b[3]]), stack.last().cloned().ok_or_else(|| err("LONG_BINPUT on an empty stack".into()))?);
            }
            0x94 => {
                let k = memo.len() as u32; // MEMOIZE
                memo.insert(k, stack.last().cloned().ok_or_else(|| err("MEMOIZE on an empty stack".into()))?);
            }
            b'h' | b'j' => {
                let k = if op == b'h' {
                    take(&mut i, 1)?[0] as u32
                } else {
                    let b = take(&mut i, 4)?;
                    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
                };
                stack.push(memo.get(&k).cloned().ok_or_else(|| err(format!("memo {k} unset")))?)
            }
            b't' => {
                let items = pop_mark(&mut stack, &mut marks)?;
                stack.push(Value::Tuple(items))
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize; // TUPLE1..3
                if stack.len() < n {
                    return Err(err("stack underflow".into()));
                }
                let items = stack.split_off(stack.len() - n);
                stack.push(Value::Tuple(items))
            }
            b'l' => {
                let items = pop_mark(&mut stack, &mut marks)?;
                stack.push(Value::List(items))
            }
            b'a' | b'e' => {
                let items = if op == b'a' { vec![pop(&mut stack)?] } else { pop_mark(&mut stack, &mut marks)? };
                match stack.last_mut() {
                    Some(Value::List(xs)) => xs.extend(items),
                    _ => return Err(err("APPEND to a non-list".into())),
                }
            }
            b's' | b'u' => {
                let items = if op == b's' {
                    let v = pop(&mut stack)?;
                    let k = pop(&mut stack)?;
                    vec![k, v]
                } else {
                    pop_mark(&mut stack, &mut marks)?
                };
                match stack.last_mut() {
                    Some(Value::Dict(d)) => d.extend(items.chunks(2).filter(|c| c.len() == 2).map(|c| (c[0].clone(), c[1].clone()))),
                    _ => return Err(err("SETITEM on a non-dict".into())),
                }
            }
            b'Q' => {
                // BINPERSID: ('storage', <dtype storage class>, key, location, numel)
                let pid = pop(&mut stack)?;
                let Value::Tuple(t) = pid else { return Err(err("a persistent id that is not a tuple".into())) };
                match (t.get(1), t.get(2)) {
                    (Some(Value::Global(class)), Some(Value::Str(key))) => {
                        let kind = storage_kind(class).ok_or_else(|| err(format!("a storage of unknown type {class}")))?;
                        stack.push(Value::Storage { kind, key: key.clone() })
                    }
                    _ => return Err(err("a persistent id that is not a storage".into())),
                }
            }
            0x81 => {
                // NEWOBJ: cls, args
                let _args = pop(&mut stack)?;
                let cls = pop(&mut stack)?;
                let Value::Global(class) = cls else { return Err(err("NEWOBJ of a non-class".into())) };
                stack.push(Value::Object { class, state: Box::new(Value::Other) })
            }
            b'R' => {
                let args = pop(&mut stack)?;
                let callable = pop(&mut stack)?;
                let Value::Global(f) = callable else { return Err(err("REDUCE of a non-global".into())) };
                let a = match args {
                    Value::Tuple(a) => a,
                    _ => return Err(err("REDUCE without an argument tuple".into())),
                };
                stack.push(match f.as_str() {
                    "torch._utils _rebuild_tensor_v2" | "torch._utils _rebuild_tensor" => match (a.first(), a.get(1), a.get(2).and_then(ints), a.get(3).and_then(ints)) {
                        (Some(Value::Storage { kind, key }), Some(Value::Int(offset)), Some(size), Some(stride)) => {
                            Value::Tensor { kind: *kind, key: key.clone(), offset: *offset, size, stride }
                        }
                        _ => return Err(err(format!("{f} with unexpected arguments"))),
                    },
                    "collections OrderedDict" => Value::Dict(vec![]),
                    _ => Value::Other,
                })
            }
            b'b' => {
                // BUILD: set the state of the object below
                let state = pop(&mut stack)?;
                match stack.last_mut() {
                    Some(Value::Object { state: s, .. }) => **s = state,
                    Some(_) => {} // state of something we do not model (an OrderedDict's, a tensor's)
                    None => return Err(err("BUILD on an empty stack".into())),
                }
            }
            other => return Err(err(format!("pickle opcode 0x{other:02x} is not one TorchScript archives use here"))),
        }
    }
}

/// `__buffers__` of every class in the archive's code, by qualified class name
/// (`__torch__.torch.nn.modules.batchnorm.BatchNorm1d`).
fn declared_buffers(files: &[(String, String)]) -> HashMap<String, Vec<String>> {
    let mut out = HashMap::new();
    for (name, text) in files {
        // `<root>/code/__torch__/a/b.py` holds classes of module `__torch__.a.b`.
        let Some(code) = name.split_once("/code/").map(|(_, c)| c) else { continue };
        let module = code.trim_end_matches(".py").replace('/', ".");
        let mut class: Option<String> = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("class ") {
                class = rest.split(['(', ':']).next().map(|c| format!("{module}.{}", c.trim()));
            } else if let (Some(c), Some(list)) = (&class, line.trim().strip_prefix("__buffers__ = [")) {
                let names = list.trim_end_matches(']').split(',').map(|s| s.trim().trim_matches('"').to_string()).filter(|s| !s.is_empty()).collect();
                out.insert(c.clone(), names);
            }
        }
    }
    out
}

/// The buffers of the TorchScript archive at `path`, `(dotted name, value as saved)`, on the CPU.
pub fn buffers(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let file = std::fs::File::open(path).map_err(|error| Error::Io { path: path.into(), error })?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| bad(path, format!("not a zip archive ({e})")))?;
    let names: Vec<String> = (0..zip.len()).filter_map(|i| zip.by_index_raw(i).ok().map(|f| f.name().to_string())).collect();
    let mut read = |name: &str| -> Result<Vec<u8>> {
        let mut f = zip.by_name(name).map_err(|e| bad(path, format!("{name}: {e}")))?;
        let mut bytes = vec![];
        f.read_to_end(&mut bytes).map_err(|error| Error::Io { path: path.into(), error })?;
        Ok(bytes)
    };
    let pkl = names.iter().find(|n| n.ends_with("/data.pkl") && n.matches('/').count() == 1).cloned().ok_or_else(|| bad(path, "no data.pkl".into()))?;
    let root = pkl.trim_end_matches("data.pkl").to_string();
    let code: Vec<(String, String)> = names
        .iter()
        .filter(|n| n.starts_with(&format!("{root}code/")) && n.ends_with(".py"))
        .map(|n| Ok((n.clone(), String::from_utf8_lossy(&read(n)?).into_owned())))
        .collect::<Result<_>>()?;
    let declared = declared_buffers(&code);
    let tree = unpickle(&read(&pkl)?, path)?;
    let mut found = vec![];
    walk(&tree, "", &declared, &mut found);
    found
        .into_iter()
        .map(|(name, kind, key, offset, size, stride)| {
            let bytes = read(&format!("{root}data/{key}"))?;
            let element = kind.elt_size_in_bytes();
            let storage = Tensor::f_from_data_size(&bytes, &[(bytes.len() / element) as i64], kind).map_err(|e| bad(path, format!("{name}: {e}")))?;
            let t = storage.f_as_strided(&size, &stride, offset).map_err(|e| bad(path, format!("{name}: {e}")))?;
            Ok((name, t.copy()))
        })
        .collect()
}

type Found = (String, Kind, String, i64, Vec<i64>, Vec<i64>);

fn walk(v: &Value, prefix: &str, declared: &HashMap<String, Vec<String>>, found: &mut Vec<Found>) {
    let Value::Object { class, state } = v else { return };
    let Value::Dict(entries) = state.as_ref() else { return };
    let qualified = class.replacen(' ', ".", 1);
    let buffers = declared.get(&qualified);
    for (k, value) in entries {
        let Value::Str(attr) = k else { continue };
        let name = format!("{prefix}{attr}");
        match value {
            Value::Tensor { kind, key, offset, size, stride } if buffers.is_some_and(|b| b.contains(attr)) => {
                found.push((name, *kind, key.clone(), *offset, size.clone(), stride.clone()))
            }
            Value::Object { .. } => walk(value, &format!("{name}."), declared, found),
            _ => {}
        }
    }
}
