// Checking, before any work, that a folder an output will go to can be made and written.
#pragma once

#include <string>

namespace loom {

// Throws IoError naming `what` (e.g. "checkpoint.dir"), the path and the fix when files could not be
// written into the folder `dir`: a name on the way that is a file, not a folder; the nearest existing
// folder not writable; a name or path longer than the filesystem allows. Creates nothing, so a run
// that never writes there leaves nothing behind. Meant for outputs written late (the first
// checkpoint, a trace, a report after minutes of measuring), where finding out then loses the work.
void check_output_folder(const std::string& dir, const std::string& what);
// The same for a file to be written at `path` (its folder; and the path itself must not be a folder,
// nor a read-only file). Creates nothing and leaves an existing file as it is.
void check_output_file(const std::string& path, const std::string& what);

}  // namespace loom
