package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/kvlease/kvlease"
)

// apiError is an error as OpenAI's API answers it: an HTTP status and a
// JSON body
//
//	{"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": "unsupported_value"}}
//
// (param and code null when they do not apply). Every error the server
// answers is one of these, with a message written for the client: no Go
// type, field or package name, nothing from the library's internals.
type apiError struct {
	status     int
	typ        string
	code       string // "" → null
	param      string // "" → null
	msg        string
	retryAfter int // seconds; set on 503s the client should retry
}

func (e *apiError) Error() string { return e.msg }

// The error types OpenAI's clients tell apart.
const (
	invalidRequest = "invalid_request_error"
	authError      = "authentication_error"
	permissionErr  = "permission_error"
	serverError    = "server_error"
)

// badParam is a 400 about one parameter.
func badParam(param, code, format string, args ...any) *apiError {
	return &apiError{status: http.StatusBadRequest, typ: invalidRequest, code: code, param: param, msg: fmt.Sprintf(format, args...)}
}

// unsupported refuses a parameter this engine does not implement, rather
// than ignoring it (a client asking for two choices must not get one).
func unsupported(param, format string, args ...any) *apiError {
	return badParam(param, "unsupported_parameter", format, args...)
}

var (
	errUnauthorized = &apiError{status: http.StatusUnauthorized, typ: authError, code: "invalid_api_key",
		msg: "a valid API key is required (Authorization: Bearer KEY)"}
	errAdminDisabled = &apiError{status: http.StatusForbidden, typ: permissionErr, code: "admin_disabled",
		msg: "the adapter endpoints are disabled: the engine was started without an admin key (-admin-key-file) or -open-admin"}
	errAdminKey = &apiError{status: http.StatusUnauthorized, typ: authError, code: "invalid_api_key",
		msg: "the adapter endpoints need the admin key (Authorization: Bearer KEY)"}
	errTooLarge = &apiError{status: http.StatusRequestEntityTooLarge, typ: invalidRequest, code: "request_too_large",
		msg: fmt.Sprintf("the request body is larger than %d bytes", maxBody)}
	errBusyAPI = &apiError{status: http.StatusServiceUnavailable, typ: serverError, code: "overloaded",
		msg: "the engine's waiting queue is full; retry later", retryAfter: 1}
	errShutdownAPI = &apiError{status: http.StatusServiceUnavailable, typ: serverError, code: "shutting_down",
		msg: "the engine is shutting down", retryAfter: 1}
	errInternal = &apiError{status: http.StatusInternalServerError, typ: serverError,
		msg: "the engine could not complete this request"}
	errQuotaAPI = &apiError{status: http.StatusTooManyRequests, typ: "insufficient_quota", code: "insufficient_quota",
		msg: "this request's KV does not fit within your quota beside your running requests; retry when they finish", retryAfter: 1}
)

func notFoundModel(model string) *apiError {
	return &apiError{status: http.StatusNotFound, typ: invalidRequest, code: "model_not_found", param: "model",
		msg: fmt.Sprintf("the model %q does not exist (GET /v1/models lists the served ones)", model)}
}

// toAPIError is err as the client sees it: an *apiError as it is; the
// engine's own errors by what they mean; anything else an internal error
// whose text stays in the server.
func toAPIError(err error) *apiError {
	var ae *apiError
	switch {
	case errors.As(err, &ae):
		return ae
	case errors.Is(err, errBusy):
		return errBusyAPI
	case errors.Is(err, errShutdown):
		return errShutdownAPI
	case errors.Is(err, kvlease.ErrQuota):
		return errQuotaAPI
	}
	return errInternal
}

// errorBody is the JSON an error is written as.
type errorBody struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    *string `json:"code"`
	} `json:"error"`
}

func (e *apiError) body() errorBody {
	var b errorBody
	b.Error.Message, b.Error.Type = e.msg, e.typ
	if e.param != "" {
		b.Error.Param = &e.param
	}
	if e.code != "" {
		b.Error.Code = &e.code
	}
	return b
}

// writeError answers err (see toAPIError) with its status and JSON body.
func writeError(w http.ResponseWriter, err error) {
	e := toAPIError(err)
	if e.retryAfter > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(e.retryAfter))
	}
	writeJSON(w, e.status, e.body())
}

// jsonError turns a JSON decoding error into a client's message: where
// the body stops being JSON, or which parameter has the wrong type.
func jsonError(err error) *apiError {
	var syn *json.SyntaxError
	var typ *json.UnmarshalTypeError
	switch {
	case errors.As(err, &syn):
		return badParam("", "invalid_json", "the request body is not valid JSON (at byte %d)", syn.Offset)
	case errors.As(err, &typ) && typ.Field != "":
		// The path is the JSON names', but for the embedded struct's
		// (Go's name), which the client never wrote.
		field := strings.TrimPrefix(typ.Field, "commonRequest.")
		return badParam(field, "invalid_type", "%s must be %s, not %s", field, jsonKind(typ.Type.Kind().String()), jsonValueName(typ.Value))
	case errors.As(err, &typ):
		return badParam("", "invalid_type", "the request body must be a JSON object, not %s", jsonValueName(typ.Value))
	}
	return badParam("", "invalid_json", "the request body is not valid JSON")
}

// jsonKind names a Go kind as JSON calls it.
func jsonKind(kind string) string {
	switch kind {
	case "int", "int8", "int16", "int32", "int64", "uint", "uint8", "uint16", "uint32", "uint64":
		return "an integer"
	case "float32", "float64":
		return "a number"
	case "bool":
		return "a boolean"
	case "string":
		return "a string"
	case "slice", "array":
		return "an array"
	}
	return "an object"
}

// jsonValueName names what a json.UnmarshalTypeError says it found.
func jsonValueName(v string) string {
	switch v {
	case "string", "bool", "array", "object":
		return map[string]string{"string": "a string", "bool": "a boolean", "array": "an array", "object": "an object"}[v]
	}
	if len(v) > 6 && v[:6] == "number" {
		return "the number " + v[7:]
	}
	return "a " + v
}
