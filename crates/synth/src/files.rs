//! A synthetic model's checkpoints written to files one tensor at a time, for models
//! whose training state does not fit in memory: [`Synth`](crate::Synth) holds FP32
//! master weights and momentum for every tensor (8 bytes an element, 64 GB for the 8B
//! shape), while [`write_checkpoints`] holds one tensor's (5 GB for the 8B shape's
//! embedding, its largest). Each tensor evolves independently of the others, so it can
//! be made, stepped through every version and exported into every file before the next
//! is made. The files are byte for byte those of writing each [`Synth::export`].

use std::borrow::Cow;
use std::fs::{self, OpenOptions};
use std::path::{Path, PathBuf};

use aurora_checkpoint::FileError;
use aurora_delta::safetensors_layout;
use memmap2::MmapMut;

use crate::{SynthConfig, TensorSpec, TensorState};

/// Writes versions `first..first + paths.len()` of `config`'s model to `paths` (version
/// `first + i` to `paths[i]`), each file appearing under its name only once complete.
/// The versions before `first` are computed, not written: a caller short of disk writes
/// a chain a few versions at a time. `progress` is called with the bytes written so
/// far, out of the total of every file.
pub fn write_checkpoints(
    config: &SynthConfig,
    first_version: u64,
    paths: &[PathBuf],
    mut progress: impl FnMut(u64, u64),
) -> Result<(), FileError> {
    let specs = config.shape.tensors();
    let Some(first) = paths.first() else {
        return Ok(());
    };
    let bytes_per_file: u64 = specs
        .iter()
        .map(|spec| {
            elements(spec) * TensorState::export_dtype(spec, config.f32_norms).size_bytes() as u64
        })
        .sum();
    let total = bytes_per_file * paths.len() as u64;
    let mut done = 0;

    // The first version through safetensors itself, which lays the file out; tensors
    // are made one at a time as it asks for their data.
    let first_temporary = temporary(first);
    let views = specs.iter().enumerate().map(|(index, spec)| {
        let shape = spec.shape.iter().map(|&d| d as usize).collect();
        let view = LazyExport {
            config,
            version: first_version,
            index,
            spec,
            shape,
        };
        (spec.name.clone(), view)
    });
    safetensors::serialize_to_file(views, None, &first_temporary).map_err(|error| {
        FileError::Serialize {
            path: first.clone(),
            reason: error.to_string(),
        }
    })?;
    done += bytes_per_file;
    progress(done, total);

    // Every later version: the same layout, so a copy of the first is patched tensor by
    // tensor through a map.
    let mut later = Vec::new();
    for path in &paths[1..] {
        let temporary = temporary(path);
        fs::copy(&first_temporary, &temporary).map_err(io(&temporary))?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&temporary)
            .map_err(io(&temporary))?;
        // SAFETY: the temporary file is this function's alone until it is renamed.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(io(&temporary))?;
        later.push((temporary, file, map));
    }
    if let Some((_, _, map)) = later.first() {
        let layout = safetensors_layout(map).map_err(|error| FileError::Serialize {
            path: first.clone(),
            reason: error.to_string(),
        })?;
        for (index, spec) in specs.iter().enumerate() {
            let range = layout
                .iter()
                .find(|tensor| tensor.name == spec.name)
                .map(|tensor| tensor.bytes.clone())
                .expect("every tensor of the shape is in the file made from it");
            let mut state = TensorState::at(config, index, spec, first_version);
            for (step, (_, _, map)) in (first_version + 1..).zip(later.iter_mut()) {
                state.step(step, config.learning_rate);
                state.export_into(config.f32_norms, &mut map[range.clone()]);
                done += range.len() as u64;
                progress(done, total);
            }
        }
    }
    for ((temporary, file, map), path) in later.into_iter().zip(&paths[1..]) {
        map.flush().map_err(io(&temporary))?;
        file.sync_all().map_err(io(&temporary))?;
        fs::rename(&temporary, path).map_err(io(path))?;
    }
    fs::rename(&first_temporary, first).map_err(io(first))?;
    Ok(())
}

fn elements(spec: &TensorSpec) -> u64 {
    spec.shape.iter().product()
}

/// Where `path` is written until it is complete.
fn temporary(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.partial"))
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> FileError + '_ {
    move |source| FileError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A tensor of `version`, made only when safetensors asks for its data.
struct LazyExport<'a> {
    config: &'a SynthConfig,
    version: u64,
    index: usize,
    spec: &'a TensorSpec,
    /// The spec's shape as safetensors asks for it.
    shape: Vec<usize>,
}

impl safetensors::View for LazyExport<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        TensorState::export_dtype(self.spec, self.config.f32_norms).to_safetensors()
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let state = TensorState::at(self.config, self.index, self.spec, self.version);
        Cow::Owned(state.export(self.config.f32_norms).data)
    }

    fn data_len(&self) -> usize {
        elements(self.spec) as usize
            * TensorState::export_dtype(self.spec, self.config.f32_norms).size_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Synth, preset};

    #[test]
    fn files_written_tensor_by_tensor_are_those_of_the_whole_model() {
        let dir = tempfile::tempdir().unwrap();
        for f32_norms in [false, true] {
            let config = SynthConfig {
                f32_norms,
                learning_rate: 1e-3,
                ..SynthConfig::new(preset("tiny").unwrap(), 5)
            };
            let paths: Vec<PathBuf> = (0..4)
                .map(|v| dir.path().join(format!("{f32_norms}-{v}.safetensors")))
                .collect();
            let mut reported = Vec::new();
            write_checkpoints(&config, 0, &paths, |done, total| {
                reported.push((done, total))
            })
            .unwrap();
            let mut synth = Synth::new(config);
            for (version, path) in paths.iter().enumerate() {
                if version > 0 {
                    synth.step();
                }
                let expected = aurora_checkpoint::safetensors_bytes(&synth.export()).unwrap();
                assert_eq!(fs::read(path).unwrap(), expected, "version {version}");
            }
            let (done, total) = *reported.last().unwrap();
            assert_eq!(done, total);
        }
        // Nothing but the finished files.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 8);
    }

    #[test]
    fn a_chain_written_from_a_later_version_is_the_same_chain() {
        let dir = tempfile::tempdir().unwrap();
        let config = SynthConfig {
            learning_rate: 1e-3,
            ..SynthConfig::new(preset("tiny").unwrap(), 5)
        };
        let path = |name: &str| dir.path().join(name);
        let whole = [path("0"), path("1"), path("2"), path("3")];
        write_checkpoints(&config, 0, &whole, |_, _| {}).unwrap();
        let tail = [path("2-again"), path("3-again")];
        write_checkpoints(&config, 2, &tail, |_, _| {}).unwrap();
        assert_eq!(fs::read(&whole[2]).unwrap(), fs::read(&tail[0]).unwrap());
        assert_eq!(fs::read(&whole[3]).unwrap(), fs::read(&tail[1]).unwrap());
    }
}
