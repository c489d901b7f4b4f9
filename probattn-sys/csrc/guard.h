// The exception boundary every `extern "C"` function of the C++ layer goes through: messages
// handed to Rust, the guard that turns any exception into one, and the checks of the pointers a
// function requires. Only the standard library and c10's exception type: csrc/memory.cpp, also
// built alone as a shared library for Python, includes it too.
#pragma once

#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>

#include <c10/util/Exception.h>

namespace probattn {

// The message returned when not even the message can be allocated: static, so pa_string_free
// (csrc/common.cpp) must not free it, and it does not. A failure is never reported as NULL,
// which the Rust side reads as success.
inline char kNoMemoryForMessage[] = "out of memory (and no memory left for the error's own message)";

// A malloc'd copy of `s` for Rust (freed by pa_string_free); throws std::bad_alloc when there is
// no memory, so that a caller inside `guard` never hands out NULL for a string.
inline char* copy_string(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out == nullptr) throw std::bad_alloc();
  std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

// copy_string for a message: the static message above when even that fails.
inline char* message_of(const char* what) noexcept {
  try {
    return copy_string(what);
  } catch (...) {
    return kNoMemoryForMessage;
  }
}

// Runs `body`; returns NULL on success, else the exception's message (libtorch's without its C++
// backtrace), never NULL on failure.
template <typename F>
char* guard(F&& body) noexcept {
  try {
    body();
    return nullptr;
  } catch (const c10::Error& e) {
    return message_of(e.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    return message_of("out of memory in the C++ layer (std::bad_alloc)");
  } catch (const std::exception& e) {
    return message_of(e.what());
  } catch (...) {
    return message_of("an unknown C++ exception");
  }
}

// Runs a destructor's body; what it throws is dropped (there is no caller to tell), never
// propagated through the C boundary.
template <typename F>
void guard_release(F&& body) noexcept {
  try {
    body();
  } catch (...) {
  }
}

// Throws, naming the function and the argument, when a pointer the function requires is NULL.
inline void require(const void* pointer, const char* function, const char* argument) {
  if (pointer == nullptr) throw std::invalid_argument(std::string(function) + ": `" + argument + "` is NULL");
}

}  // namespace probattn
